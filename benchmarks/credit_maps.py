"""What the credit maps and diagnostics cost in an iteration of the demo, as a ratio in the same process.

Trains ``examples/demo_cpu.yaml`` (FIPO on two-digit addition; ``--algorithm`` to change) for ``--steps``
iterations in this process, with a credit map written at *every* iteration (``logging.credit_map_every=1``,
the worst case; the default writes one with each validation, every 20 iterations). Each iteration's
``time/credit_s`` (the diagnostics, the algorithm's credit fields and the map: ``trainer/step.credit_diagnostics``)
is compared with its ``time/step_s``; the first iteration is left out (start-up). Goal: under 2%.

    python benchmarks/credit_maps.py [--steps 6] [--algorithm fipo] [--warmup-steps 0]

The warm-up is skipped by default (the cost of an iteration does not depend on how good the policy is;
``--warmup-steps 800`` runs the demo's).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--algorithm", default="fipo")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--out", default=None, help="the run directory (default: a temporary one)")
    args = ap.parse_args()

    from megatron_credit import distributed
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.trainer.loop import train

    out = args.out or tempfile.mkdtemp(prefix="credit_maps_bench_")
    recipe = load_recipe(str(ROOT / "examples" / "demo_cpu.yaml"), overrides=[
        f"algorithm.name={args.algorithm}", f"train.steps={args.steps}", "train.val_every=0",
        f"warmup.steps={args.warmup_steps}", "logging.credit_map_every=1", "logging.progress=false",
        "logging.plots=false", "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.save_at_end=false"])
    device = distributed.initialize(recipe.parallel, seed=recipe.seed, timeout_s=recipe.distributed.timeout_s)
    try:
        rows = train(recipe, recipe.model.hf_config(), run_dir=out, device=device, resume="none", log=lambda *a: None)
    finally:
        distributed.destroy()
    timed = rows[1:] or rows
    credit = [r["time/credit_s"] for r in timed]
    step = [r["time/step_s"] for r in timed]
    ratio = sum(credit) / sum(step)
    print(f"demo ({args.algorithm}), {len(timed)} iterations timed, a credit map at each: "
          f"step {statistics.median(step):.3f} s, credit (diagnostics + map) {statistics.median(credit) * 1e3:.1f} ms "
          f"(median); ratio {100 * ratio:.2f}% of an iteration (goal: under 2%)")
    print(f"maps: {sorted(os.listdir(os.path.join(out, 'credit_maps')))[:4]} ... in {out}")
    if ratio >= 0.02:
        raise SystemExit(f"credit maps cost {100 * ratio:.2f}% of an iteration, over the 2% goal")


if __name__ == "__main__":
    main()
