"""Iteration time of ``rollout.mode`` sync against one_step_off and async, and the fraction of generation
hidden behind training, at the demo's shape and with a simulated long-tail generator (CPU, 2 ranks each:
sync on 2 trainer ranks, the pool modes on 1 trainer rank + 1 pool rank), as ratios measured in one run,
with the bytes each iteration moves (weights to the engines, samples to the trainer).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/async_rollout.py [--steps 12] [--tail-s 0.05]

Two generators, each run in the three modes (``examples/demo_cpu.yaml``, the warm-up cached, no
validation, ``--steps`` iterations; the first two are left out of the means):

- ``hf``: the demo's own engine. On 2 shared cores generation and training contend for the same CPU, so
  the absolute gain is small; the hidden fraction is the figure.
- ``tail``: the same samples, and then the wall time a GPU engine would add: ``--tail-s`` per token of
  the draw's longest response, where one draw in ten has a response 20 times longer than the others
  (the longest response sets the pace of a synchronous iteration). The wait is a sleep, off the CPU, as
  generation on GPUs of its own would be.

Printed per generator and mode: the mean iteration time (``time/step_s``), the hidden fraction
(``time/rollout_hidden_frac``: 1 - the trainer's wait / the generation's wall time), the mean staleness,
and the ratio sync / mode.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_credit.rollout.engine import ROLLOUT_ENGINES  # noqa: E402
from megatron_credit.rollout.hf_engine import HFRolloutEngine  # noqa: E402

TAIL_EVERY, TAIL_FACTOR = 10, 20


@ROLLOUT_ENGINES.register("tail")
class LongTailEngine(HFRolloutEngine):
    """The HF engine, and then the wall time of a long-tail generator (module docstring): registered when
    this file is imported (every run loads it with ``--plugin``, its pool ranks too)."""

    per_token_s = float(os.environ.get("MC_BENCH_TAIL_S", "0.05"))

    def generate(self, prompts, params, *, group_ids=None):
        out = self.generate_samples(prompts, params, group_ids=group_ids)
        rng = random.Random(params.seed)
        longest = max((len(s.response_ids) for s in out.samples), default=0)
        time.sleep(self.per_token_s * longest * (TAIL_FACTOR if rng.randrange(TAIL_EVERY) == 0 else 1))
        return out

    def generate_samples(self, prompts, params, *, group_ids=None):
        return HFRolloutEngine.generate(self, prompts, params, group_ids=group_ids)


def run(mode: list[str], *, engine: str, steps: int, out_dir: str) -> dict[str, float]:
    """One run of the demo recipe in ``mode`` (``ranks``: torchrun's count, 1: no launcher, and overrides);
    the means of its iterations after the second."""
    import json
    import subprocess

    ranks, overrides = mode[0], mode[1:]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(_free_port())] if ranks > 1 else [sys.executable])
    cmd = [*launch, os.path.join(ROOT, "pretrain_rl.py"), "--plugin", os.path.abspath(__file__), "--config",
           os.path.join(ROOT, "examples", "demo_cpu.yaml"), "--output-dir", out_dir, f"train.steps={steps}",
           "train.val_every=0", "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
           "checkpoint.every=0", "checkpoint.save_at_end=false", f"rollout.engine={engine}", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][2:]
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
    return {"step_s": mean("time/step_s"), "hidden": mean("time/rollout_hidden_frac"),
            "staleness": mean("rollout/staleness_mean"), "engine_s": mean("time/rollout_engine_s"),
            "weight_bytes": mean("transfer/weight_bytes"), "sample_bytes": mean("transfer/sample_bytes")}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = {"sync (2 ranks)": [2, "rollout.mode=sync"],
         "one_step_off (1 + 1)": [1, "rollout.mode=one_step_off", "rollout.ranks=1"],
         "async(2) (1 + 1)": [1, "rollout.mode=async", "rollout.max_staleness=2", "rollout.ranks=1"]}
"""Each mode at the same total ranks: sync on 2 trainer ranks (both generate), the pool modes with 1 trainer
rank and a pool rank (``pretrain_rl.py`` starts it)."""


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tail-s", type=float, default=0.05, help="seconds per token of a draw's longest response")
    ap.add_argument("--engines", default="hf,tail")
    args = ap.parse_args()
    os.environ["MC_BENCH_TAIL_S"] = str(args.tail_s)  # every run's processes read it when they import this file
    LongTailEngine.per_token_s = args.tail_s
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines.split(","):
            got = {}
            for name, mode in MODES.items():
                got[name] = run(mode, engine=engine, steps=args.steps, out_dir=os.path.join(tmp, f"{engine}-{name}"))
            base = got["sync (2 ranks)"]["step_s"]
            for name, m in got.items():
                print(f"{engine:>4} {name:>20}: iteration {m['step_s']:.3f} s, generation {m['engine_s']:.3f} s, "
                      f"hidden {m['hidden']:.2f}, staleness {m['staleness']:.2f}, sync / this = {base / m['step_s']:.2f}; "
                      f"per iteration: weights {m['weight_bytes'] / 2**20:.2f} MiB to engines, samples "
                      f"{m['sample_bytes'] / 2**10:.1f} KiB", flush=True)


if __name__ == "__main__":
    main()
