"""Ratio benchmark of CompPO's attention concentration kernel vs dense attention.

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/concentration.py [--lengths 2048 8192 16384]
        [--device cpu|cuda] [--dense-max 8192] [--repeats 1] [--topk 0]

At B = 1, Hq = 8, Hkv = 2, D = 64, Tq = Tk = T, float32, for each T it prints the time and the peak
extra memory of

- ``conc``: :func:`megatron_credit.models.concentration.attention_concentration` (chunk 1024);
- ``topk``: :func:`~megatron_credit.models.concentration.attention_topk` with k = ``--topk`` (0: skip);
- ``dense``: the same H from a materialised causal softmax (``[B, Hq, T, T]`` float32 scores, GQA by
  repeating K as megatron's local ``DotProductAttention`` does), i.e. what dense attention costs;

and the ratios dense / conc. Each measurement runs in a fresh subprocess. Peak extra memory: on CPU
the resident-set high-water mark above the inputs (``/proc/self/clear_refs``, ``VmHWM``, with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set, after a tiny warm-up call
so that library code paged in on first use is not counted; Linux only); on CUDA
``torch.cuda.max_memory_allocated`` above the inputs. Dense is skipped above ``--dense-max`` (CPU
default 8192: at 16K one score buffer is 8 GiB and softmax needs three). Times are best-of-``--repeats``
after one warm-up on CUDA; the CPU machine may be shared.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_credit.models.concentration import attention_concentration, attention_topk  # noqa: E402

B, HQ, HKV, D = 1, 8, 2, 64


def dense_concentration(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``H [B, T]`` through a materialised ``[B, Hq, T, T]`` float32 causal softmax."""
    t = q.shape[2]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    a = torch.softmax(s, dim=-1)
    del s
    return a.square_().sum(-1).mean(1)


def _kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))


def measure_one(what: str, t: int, device: str, repeats: int, topk: int) -> dict:
    """Time (best of ``repeats``) and peak extra bytes of one kernel at length ``t``; run in a subprocess."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, HQ, t, D, generator=g, device=device)
    k = torch.randn(B, HKV, t, D, generator=g, device=device)
    kernel = {"conc": attention_concentration, "topk": lambda q, k: attention_topk(q, k, topk),
              "dense": dense_concentration}[what]
    fn = functools.partial(kernel, q, k)
    cuda = device.startswith("cuda")
    if cuda:
        fn()  # warm-up (kernels, allocator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        kernel(q[:, :, :64], k[:, :, :64])  # warm-up: library code paged in on first use is not counted
        open("/proc/self/clear_refs", "w").write("5")
        base = _kib("VmRSS") * 1024
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        del out
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else (_kib("VmHWM") * 1024 - base)
    return {"time_s": best, "peak_bytes": peak}


def _spawn(what: str, t: int, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", what, str(t), "--device", args.device,
           "--repeats", str(args.repeats), "--topk", str(args.topk)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dense-max", type=int, default=None, help="skip dense above this T")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--topk", type=int, default=0, help="also time attention_topk with this k")
    parser.add_argument("--one", nargs=2, metavar=("KERNEL", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.device, args.repeats, args.topk)))
        return
    dense_max = args.dense_max or (8192 if args.device == "cpu" else 1 << 30)
    mib = 1 << 20
    print(f"B={B} Hq={HQ} Hkv={HKV} D={D} Tq=Tk=T float32 device={args.device} chunk=1024 "
          f"threads={torch.get_num_threads()}")
    print(f"{'T':>6} | {'conc s':>8} {'conc MiB':>9} | {'dense s':>8} {'dense MiB':>10} | "
          f"{'time dense/conc':>15} {'mem dense/conc':>14}" + (f" | {'topk s':>8} {'topk MiB':>9}" if args.topk else ""))
    for t in args.lengths:
        conc = _spawn("conc", t, args)
        dense = _spawn("dense", t, args) if t <= dense_max else None
        row = f"{t:>6} | {conc['time_s']:>8.3f} {conc['peak_bytes'] / mib:>9.1f} | "
        if dense:
            row += (f"{dense['time_s']:>8.3f} {dense['peak_bytes'] / mib:>10.1f} | "
                    f"{dense['time_s'] / conc['time_s']:>15.2f} {dense['peak_bytes'] / conc['peak_bytes']:>14.1f}")
        else:
            row += f"{'skipped':>8} {'(>' + str(dense_max) + ')':>10} | {'-':>15} {'-':>14}"
        if args.topk:
            top = _spawn("topk", t, args)
            row += f" | {top['time_s']:>8.3f} {top['peak_bytes'] / mib:>9.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
