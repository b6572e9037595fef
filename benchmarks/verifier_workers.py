"""Verifier worker throughput: N verifier calls through ``VerifierWorkers`` vs in-process sequential scoring.

    python benchmarks/verifier_workers.py --n 10000 --workers 2

Prints calls/s for both and their ratio (workers / sequential), per method. On a shared machine the wall
ratio measures the neighbours as much as the workers, so it also prints CPU-seconds per call (sequential,
and verifier workers + dispatcher, read from /proc) and the ratio those imply on ``workers`` idle cores:
sequential CPU / max(worker CPU / workers, dispatcher CPU). The responses are a fixed
mix of realistic shapes (boxed fractions, intervals, "Answer:" lines with units and trailing text),
varied by index so no two calls are identical. On a machine with W free cores the ideal ratio for
math-verify (milliseconds per call) is about W; the cheap DAPO string verifier (microseconds) is
dominated by pipe overhead, which ``--chunk-size`` amortises.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_credit.rewards.math import compute_score
from megatron_credit.rewards.verifier_workers import RewardItem, VerifierWorkers, VerifierWorkersConfig


def make_items(n: int, method: str) -> list[RewardItem]:
    """``n`` distinct (response, ground truth) pairs, about half correct."""
    shapes = [
        lambda i: (f"We simplify.\n\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}", f"\\frac{{{i}}}{{{i + 1}}}"),
        lambda i: (f"Thus the interval is \\boxed{{[{i}, {i + 3})}}.", f"[{i},{i + 2})"),
        lambda i: (f"Counting carefully.\nAnswer: {i} apples. Done.", str(i)),
        lambda i: (f"So $x = {i}.5$ and \\boxed{{{2 * i + 1}/2}}", f"{i}.5"),
        lambda i: (f"Answer: {i},{i % 1000:03d} dollars", f"{i}{i % 1000:03d}"),
        lambda i: (f"\\boxed{{\\sqrt{{{i * i}}}}}", str(i + (i % 2))),
    ]
    items = []
    for i in range(n):
        response, gt = shapes[i % len(shapes)](i + 2)
        items.append(RewardItem(response=response, ground_truth=gt, method=method))
    return items


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(n: int, workers: int, chunk_size: int, method: str) -> None:
    items = make_items(n, method)
    compute_score(items[0].response, items[0].ground_truth, method=method)  # warm imports
    t0, c0 = time.perf_counter(), time.process_time()
    sequential = [compute_score(it.response, it.ground_truth, method=method) for it in items]
    seq_s, seq_cpu = time.perf_counter() - t0, time.process_time() - c0
    with VerifierWorkers(VerifierWorkersConfig(num_workers=workers, chunk_size=chunk_size, timeout_s=30.0)) as vw:
        vw.score_batch(items[: 4 * workers])  # workers up and warm
        pids = vw.worker_pids()
        w0 = sum(_cpu_seconds(p) for p in pids)
        t0, c0 = time.perf_counter(), time.process_time()
        records, metrics = vw.score_batch(items)
        workers_s, parent_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert vw.worker_pids() == pids, "no worker was replaced"
        worker_cpu = sum(_cpu_seconds(p) for p in pids) - w0
    assert records == sequential, "the verifier workers and in-process scoring disagree"
    acc = sum(r.correct for r in records) / n
    idle_ratio = seq_cpu / max(worker_cpu / workers, parent_cpu)
    print(
        f"{method:12s} n={n} workers={workers} chunk={chunk_size}: "
        f"sequential {n / seq_s:9.0f} calls/s | workers {n / workers_s:9.0f} calls/s | "
        f"ratio workers/sequential {seq_s / workers_s:5.2f}x | accuracy {acc:.2f} | "
        f"timeouts {metrics['verifier/timeouts']:.0f} errors {metrics['verifier/errors']:.0f}\n"
        f"{'':12s} CPU us/call: sequential {1e6 * seq_cpu / n:8.1f} | "
        f"verifier workers {1e6 * worker_cpu / n:8.1f} "
        f"+ dispatcher {1e6 * parent_cpu / n:8.1f} | ratio on {workers} idle cores {idle_ratio:5.2f}x | "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )


def startup(workers: int, restarts: int = 3) -> None:
    """Verifier workers' start and a worker's restart (start to ready) time, the parent trainer-like (torch
    imported).

    Workers are ``python -m`` processes: they must not pay for the parent's imports.
    """
    t0 = time.perf_counter()
    import torch  # noqa: F401  (the trainer's main module imports torch and megatron)

    heavy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with VerifierWorkers(VerifierWorkersConfig(num_workers=workers)) as vw:
        start_s = time.perf_counter() - t0
        times = []
        for _ in range(restarts):
            t0 = time.perf_counter()
            w = vw._start_worker()
            w.wait_ready()
            times.append(time.perf_counter() - t0)
            w.kill()
    print(f"startup: parent imports torch in {heavy_s:.2f} s | start of {workers} workers "
          f"{start_s:.2f} s | worker restart to ready {min(times):.2f}-{max(times):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--methods", default="math_verify,dapo")
    parser.add_argument("--startup", action="store_true", help="only measure the workers' start/restart time")
    args = parser.parse_args()
    if args.startup:
        startup(args.workers)
        return
    for method in args.methods.split(","):
        run(args.n, args.workers, args.chunk_size, method)


if __name__ == "__main__":
    main()
