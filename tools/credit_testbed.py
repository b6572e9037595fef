"""The credit-assignment testbed: every method x seed on credit-sensitive tasks, through the real trainer.

    python tools/credit_testbed.py --methods grpo,dapo,fipo,ppo,comppo --seeds 5 --task chain6 \\
        --budget-s 300 --out runs/testbed

Each cell (task x method x seed) is one ``pretrain_rl.py`` process on ``--config`` (default
``examples/credit_testbed_cpu.yaml``) with a wall-time budget (``train.max_wall_s``), run ``--jobs`` at
a time. Every method gets the same seeds ``seed0 .. seed0 + seeds - 1``; every cell of a task starts
from the same warmed-up policy (``warmup.seed`` fixed, warmed once before the cells into
``OUT/warmup_cache``). A cell whose ``cell.json`` says ``ok`` is skipped on a re-run (resumable); a
failed cell (non-zero exit, no metrics: e.g. an algorithm the trainer cannot run yet) is recorded with
its error and re-run next time. Writes ``OUT/results.json``, ``OUT/results.md``, ``OUT/<task>.png``,
prints the table and the mechanism checks. ``--doc`` (off by default: a tool writes into the repository
only when asked) also regenerates a committed report, e.g. ``--doc docs/results/credit_testbed.md``
(the plots are copied next to it).

Methods are algorithm names with optional variants after ``:`` joined by ``+`` (``comppo:fixed+standard``,
``fipo:tau4``, ``ppo:lam=1.0``): see ``tools/testbed_methods.py``; ``key=value`` sets ``algorithm.params.key``.
Tasks: ``chain{N}`` (decisive slips anywhere), ``chain{N}early``, ``chain{N}late`` (``data/chain.py``).

Cells share the machine: with ``--jobs`` above the free cores a cell gets fewer iterations within its
budget, equally for every method. Compare methods from one invocation (or the same ``--jobs``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python tools/credit_testbed.py` from anywhere
    sys.path.insert(0, str(ROOT))

from tools import testbed_report  # noqa: E402
from tools.testbed_methods import VARIANTS, method_overrides, slug  # noqa: E402,F401

DEFAULT_CONFIG = ROOT / "examples" / "credit_testbed_cpu.yaml"
DEFAULT_DOC = ROOT / "docs" / "results" / "credit_testbed.md"

_TASK = re.compile(r"chain(\d+)(early|late)?$")


def task_overrides(task: str) -> list[str]:
    """Recipe overrides of a task name (``chain6``, ``chain6early``, ``chain8late``).

    >>> task_overrides("chain6late")
    ['data.source=synthetic_chain', 'data.num_operands=6', 'data.decisive=late', 'rollout.max_response_len=19']
    """
    from megatron_credit.data.chain import ChainConfig

    m = _TASK.match(task)
    if m is None:
        raise ValueError(f"--task: unknown task {task!r}; valid: chain<N>, chain<N>early, chain<N>late")
    chain = ChainConfig(num_operands=int(m.group(1)), decisive=m.group(2) or "any")
    return ["data.source=synthetic_chain", f"data.num_operands={chain.num_operands}",
            f"data.decisive={chain.decisive}", f"rollout.max_response_len={chain.max_response_tokens()}"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="grpo,dapo,fipo,ppo,comppo", help="comma-separated method labels")
    ap.add_argument("--task", default="chain6", help="comma-separated tasks: chain<N>[early|late]")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per method (the same for every method)")
    ap.add_argument("--seed0", type=int, default=1, help="first seed")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-time budget of a cell's RL iterations")
    ap.add_argument("--steps", type=int, default=None, help="also stop a cell after this many iterations")
    ap.add_argument("--out", default="runs/testbed", help="output directory")
    ap.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="cells run at once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per cell (OMP_NUM_THREADS)")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="base recipe of every cell")
    ap.add_argument("--warmup-seed", type=int, default=0, help="warmup.seed: one warmed-up policy per task")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for every cell (repeatable)")
    ap.add_argument("--doc", default=None, nargs="?", const=str(DEFAULT_DOC),
                    help=f"also regenerate this Markdown report and copy the plots next to it (off by default; "
                         f"--doc alone: {DEFAULT_DOC.relative_to(ROOT)})")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--note", default="", help="a paragraph for the report (what this run is for)")
    ap.add_argument("--stop-after-s", type=float, default=None,
                    help="start no new cell after this many seconds (the report covers the finished cells)")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report over finished cells")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or not args.budget_s > 0:
        ap.error("--seeds and --jobs must be >= 1 and --budget-s > 0")
    return args


def common_overrides(args, task: str) -> list[str]:
    cache = Path(args.out).resolve() / "warmup_cache"
    out = [*task_overrides(task), f"warmup.seed={args.warmup_seed}", f"warmup.cache_dir={cache}",
           f"train.max_wall_s={args.budget_s}", "logging.progress=false", "logging.plots=false",
           "logging.tensorboard=false", "checkpoint.save_at_end=false", "checkpoint.every=0"]
    if args.steps is not None:
        out.append(f"train.steps={args.steps}")
    return out + list(args.set)


def run_cell(cell_dir: Path, overrides: list[str], *, config: str, threads: int, timeout_s: float) -> dict:
    """Run one ``pretrain_rl.py`` process into ``cell_dir/run``; returns (and writes) ``cell.json``."""
    run_dir = cell_dir / "run"
    if run_dir.exists():  # an unfinished earlier attempt: start over (the budget is per attempt)
        import shutil

        shutil.rmtree(run_dir)
    cell_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "pretrain_rl.py"), "--config", config, "--output-dir", str(run_dir),
           "--resume", "none", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    t0 = time.time()
    with open(cell_dir / "log.txt", "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rows = testbed_report.read_rows(run_dir / "metrics.jsonl")
    status = "ok" if rc == 0 and rows else "failed"
    result = {"status": status, "returncode": rc, "wall_s": time.time() - t0, "iterations": len(rows),
              "command": shlex.join(cmd[1:])}
    if status != "ok":
        result["error"] = _error_tail(cell_dir / "log.txt")
    tmp = cell_dir / "cell.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, cell_dir / "cell.json")  # written last and atomically: its presence means finished
    return result


def _error_tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    errors = [ln for ln in text if ln.startswith("error:") or "Error" in ln]
    return "\n".join((errors or text)[-lines:])


def cell_done(cell_dir: Path) -> bool:
    try:
        return json.loads((cell_dir / "cell.json").read_text())["status"] == "ok"
    except (OSError, ValueError, KeyError):
        return False


def warm_up(args, task: str, out: Path) -> dict:
    """Warm the task's policy once (a one-iteration GRPO run whose warm-up fills the shared cache)."""
    cell = out / "warmup" / task
    if cell_done(cell):
        return json.loads((cell / "cell.json").read_text())
    ov = [*common_overrides(args, task), "algorithm.name=grpo", f"seed={args.warmup_seed}", "train.steps=1"]
    return run_cell(cell, ov, config=args.config, threads=max(args.threads, min(args.jobs, os.cpu_count() or 1)),
                    timeout_s=3600)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    methods = [m for m in args.methods.split(",") if m]
    tasks = [t for t in args.task.split(",") if t]
    try:
        for m in methods:
            method_overrides(m)
        for t in tasks:
            task_overrides(t)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seed0, args.seed0 + args.seeds))
    for task in tasks if not args.report_only else []:
        w = warm_up(args, task, out)
        why = "" if w["status"] == "ok" else "\n" + w.get("error", "")
        print(f"warm-up {task}: {w['status']} ({w['wall_s']:.0f}s){why}")
    # Seed-major: a study stopped early (--stop-after-s, Ctrl-C) has the same seeds for every method.
    cells = [(t, m, s) for t in tasks for s in seeds for m in methods]
    todo = [c for c in cells if not cell_done(out / "cells" / c[0] / slug(c[1]) / f"seed_{c[2]}")]
    if args.report_only:
        todo = []
    print(f"{len(cells)} cells, {len(cells) - len(todo)} already finished, {len(todo)} to run, {args.jobs} at a time")
    bar = None if args.no_progress or args.report_only else _bar(len(cells), len(cells) - len(todo))
    # A cell that hangs is stopped well past its budget (build + warm-up load + the last iteration).
    timeout = 3 * args.budget_s + 600

    def one(c):
        t, m, s = c
        if args.stop_after_s is not None and time.time() - t_start > args.stop_after_s:
            return c, {"status": "skipped"}
        ov = [*common_overrides(args, t), *method_overrides(m), f"seed={s}"]
        return c, run_cell(out / "cells" / t / slug(m) / f"seed_{s}", ov, config=args.config,
                           threads=args.threads, timeout_s=timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as executor:
        for fut in concurrent.futures.as_completed([executor.submit(one, c) for c in todo]):
            (t, m, s), res = fut.result()
            if res["status"] == "skipped":
                continue
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{t} {m} seed {s}: {res['status']}")
            if res["status"] != "ok":
                msg = f"cell {t} {m} seed {s} failed: {res.get('error', '')}"
                print(msg, file=sys.stderr) if bar is None else bar.write(msg)
    if bar is not None:
        bar.close()
    report = testbed_report.build(out, tasks=tasks, methods=methods, seeds=seeds)
    report["command"] = "python tools/credit_testbed.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report["wall_s"] = time.time() - t_start
    report["budget_s"], report["jobs"], report["note"] = args.budget_s, args.jobs, args.note
    testbed_report.write(out, report, doc=args.doc or None)
    print(testbed_report.markdown(report, plots_rel=str(out)))
    return 0


def _bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="cells", dynamic_ncols=True)


if __name__ == "__main__":
    sys.exit(main())
