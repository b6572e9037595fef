"""Import time and one forward/backward of the tiny actor at world size 1 and at TP = 2 (CPU, gloo).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_time.py [--seq 256] [--batch 4] [--iters 10]

Prints absolute times (median over ``--iters`` after two warm-up steps) and the ratio TP=2 / TP=1.
On CPU, TP = 2 adds gloo all-reduces per layer for a model far too small to amortise them, so the
ratio measures communication overhead, not a speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _import_time() -> float:
    code = ("import time; t = time.perf_counter(); import megatron_credit.models, megatron_credit.distributed;"
            " import megatron.core.models.gpt; print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _worker(rank: int, world: int, port: int, tp: int, args, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from megatron_credit import distributed
    from megatron_credit.recipe.config import TINY_QWEN2, ModelConfig, ParallelConfig
    from megatron_credit.losses.logprob import logprobs_and_entropy
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    distributed.initialize(parallel, seed=0, launch=distributed.LaunchEnv(
        rank=rank, world_size=world, master_port=port))
    from megatron.core import parallel_state as ps

    hf = ModelConfig(architecture=TINY_QWEN2).hf_config()
    model = build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, hf.vocab_size, (args.batch, args.seq), generator=g)
    pos = torch.arange(args.seq).expand(args.batch, -1)
    times = []
    for i in range(args.iters + 2):
        t = time.perf_counter()
        logp, _ = logprobs_and_entropy(model(ids, pos, None), labels,
                                       tp_group=ps.get_tensor_model_parallel_group())
        (-logp.mean()).backward()
        torch.distributed.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t)
    if rank == 0:
        results.put(statistics.median(times))
    distributed.destroy(process_group=True)


def spawn_world(worker, world: int, *args, timeout: float = 600):
    """Run ``worker(rank, world, port, *args, results)`` in ``world`` spawned processes; what the first
    of them puts in ``results`` (rank 0's measurement)."""
    import torch.multiprocessing as mp

    from megatron_credit.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    value = results.get(timeout=timeout)
    for p in procs:
        p.join()
    return value


def _step_time(tp: int, args) -> float:
    return spawn_world(_worker, tp, tp, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    print(f"import megatron_credit.models + megatron.core GPT: {_import_time():.2f} s")
    t1 = _step_time(1, args)
    t2 = _step_time(2, args)
    print(f"tiny actor fwd+bwd, batch {args.batch} x seq {args.seq}: TP=1 {t1 * 1e3:.1f} ms, "
          f"TP=2 {t2 * 1e3:.1f} ms, ratio TP=2 / TP=1 = {t2 / t1:.2f}")


if __name__ == "__main__":
    main()
