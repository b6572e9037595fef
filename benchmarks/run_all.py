"""Every benchmark of ``benchmarks/`` one after another (``make bench``), saying what runs and how long.

    python benchmarks/run_all.py [--only step_overhead,concentration] [--list]

Each benchmark runs in its own process with its default arguments; before it starts the line names it and
the time it took when measured (2 heavily shared CPU cores, :data:`BENCHMARKS`), after it ends its own time, and
at the end a table of all. The harmless warnings megatron-core prints on a CPU machine (no Transformer
Engine / Apex, :data:`megatron_credit.cli.KNOWN_HARMLESS_WARNINGS`) are filtered through
``PYTHONWARNINGS``, which the benchmarks' own worker processes inherit. ``trl_grpo_peer.py`` is listed
but not run: it needs ``trl``, never a project dependency (its docstring says how to run it in a venv of
its own). Exits with the first failing benchmark's code.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCHMARKS: tuple[tuple[str, float], ...] = (
    # (script, seconds it took with its defaults, measured 2026-12-01 on 2 CPU cores shared with other jobs,
    # load average ~10: an upper bound; the issue measured the old 7 in ~18 min on a quieter machine)
    ("credit_kernels.py", 160.0),
    ("concentration.py", 126.0),
    ("step_time.py", 66.0),
    ("step_overhead.py", 282.0),  # 2026-12-07, defaults, a quiet machine (load average ~1)
    ("rollout_cpu.py", 15.0),
    ("rollout_vllm_cpu.py", 1950.0),  # --repeats 2, measured at load average 70-900 (engine starts of 40-240 s)
    ("verifier_workers.py", 441.0),
    ("conversion_memory.py", 153.0),
    ("logprob_memory.py", 186.0),
    ("packing.py", 720.0),  # 2026-12-03, defaults, 2 cores shared with a test run
    ("async_rollout.py", 480.0),  # 2026-12-05, defaults, 6 launches of 2 ranks
    ("credit_maps.py", 15.0),  # 2026-12-04, defaults, 2 cores shared with test runs
    ("host_syncs.py", 45.0),  # 2026-12-06, defaults, 2 cores shared with five other jobs
    ("env_draw.py", 30.0),  # 2026-12-06, defaults, 2 cores shared with a training run
    ("tac_pooling.py", 25.0),  # 2026-12-07, defaults, 2 cores shared with three other jobs
)
"""What ``make bench`` runs, in order, with the wall time each took when measured."""

NOT_RUN = {"trl_grpo_peer.py": "needs trl (its own venv; see its docstring)"}

EXTRA_HARMLESS: tuple[tuple[type[Warning], str], ...] = (
    # megatron's TP layers on CPU (step_time.py's TP = 2): a CUDA stream setting, meaningless without CUDA
    (UserWarning, "When using async grad allreduce it is recommended to set the environment variable"),
)


def harmless_warnings_filter() -> str:
    """A ``PYTHONWARNINGS`` value that ignores :data:`KNOWN_HARMLESS_WARNINGS` and :data:`EXTRA_HARMLESS`
    (no commas or colons in the message prefixes, which that syntax cannot escape).

    >>> harmless_warnings_filter().split(",")[0]
    'ignore:Transformer Engine and Apex are not installed:UserWarning'
    """
    from megatron_credit.cli import KNOWN_HARMLESS_WARNINGS

    entries = []
    for category, message in (*KNOWN_HARMLESS_WARNINGS, *EXTRA_HARMLESS):
        assert "," not in message and ":" not in message, message
        entries.append(f"ignore:{message}:{category.__name__}")
    return ",".join(entries)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def plan_lines(selected) -> list[str]:
    """What will run and how long it took when measured, before anything starts."""
    total = sum(s for _, s in selected)
    lines = [f"make bench: {len(selected)} benchmarks, about {_minutes(total)} in all (as measured on 2 CPU cores "
             "shared with other jobs; yours may differ)"]
    lines += [f"  {i}. benchmarks/{name} (~{_minutes(s)})" for i, (name, s) in enumerate(selected, 1)]
    lines += [f"  not run: benchmarks/{name}: {why}" for name, why in NOT_RUN.items()]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated benchmark names (without .py)")
    ap.add_argument("--list", action="store_true", help="print what would run and exit")
    args = ap.parse_args(argv)
    selected = list(BENCHMARKS)
    if args.only:
        names = [n.strip().removesuffix(".py") + ".py" for n in args.only.split(",") if n.strip()]
        known = {name for name, _ in BENCHMARKS}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"error: --only: unknown benchmark(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
            return 2
        selected = [b for b in BENCHMARKS if b[0] in names]
    print("\n".join(plan_lines(selected)), flush=True)
    if args.list:
        return 0
    env = dict(os.environ, PYTHONWARNINGS=harmless_warnings_filter(), PYTHONUNBUFFERED="1")  # output as it comes
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    took: list[tuple[str, float, int]] = []
    t_all = time.perf_counter()
    for i, (name, expected) in enumerate(selected, 1):
        print(f"\n[{i}/{len(selected)}] benchmarks/{name} (~{_minutes(expected)} when measured)", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(HERE / name)], env=env, cwd=ROOT)
        took.append((name, time.perf_counter() - t0, code))
        print(f"[{i}/{len(selected)}] benchmarks/{name}: {'done' if code == 0 else f'FAILED (exit {code})'} in "
              f"{_minutes(took[-1][1])}", flush=True)
        if code:
            break
    print(f"\nmake bench: {len(took)} of {len(selected)} benchmarks in {_minutes(time.perf_counter() - t_all)}")
    for name, seconds, code in took:
        print(f"  {name:<24}{seconds:>8.0f} s  {'ok' if code == 0 else f'exit {code}'}")
    return next((code for _, _, code in took if code), 0)


if __name__ == "__main__":
    sys.exit(main())
