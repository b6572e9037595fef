"""The credit testbed's results: per-cell curves and summaries, the table with 95% intervals and paired
differences to GRPO, the papers' mechanism checks, plots, ``results.json`` and the Markdown report.

A cell's curve is ``accuracy/mean`` (the sampled accuracy of the iteration's rollouts) against the
cumulative wall time of its iterations (``time/step_s``) and against the samples generated
(``prompts_per_step x n x rollout/draws`` per iteration, from the run's ``config.yaml``).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from tools.testbed_methods import method_overrides, slug
from tools.testbed_stats import (Interval, curve_metrics, interaction_interval, interpolate, mean_interval,
                                 paired_interval)

METRICS = ("final", "last20", "auc")
BASELINE = "grpo"
GATE_KEYS = ("comppo/gate_mean", "comppo/gate_first_third", "comppo/gate_mid_third", "comppo/gate_last_third")
# Not logged yet: max |f_t - 1| over the first mini-batch of each iteration (FIPO's weights must be exactly 1
# there, logp == old_logp). The check below reads it once the trainer logs it under this name.
FIPO_FIRST_MB = "fipo/first_minibatch_max_abs_dev"
PAPER_GATES = {"comppo/gate_mean": 0.61, "comppo/gate_first_third": 0.52, "comppo/gate_mid_third": 0.63,
               "comppo/gate_last_third": 0.68}


def read_rows(path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` ([] if it does not exist; a torn last line is skipped)."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return rows


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def cell_summary(run_dir: Path) -> dict:
    """Curves, the three summaries and the mechanism statistics of one finished cell."""
    import yaml

    rows = read_rows(run_dir / "metrics.jsonl")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    per_draw = cfg.get("rollout", {}).get("prompts_per_step", 0) * cfg.get("rollout", {}).get("n", 0)
    times, samples, acc, t, n = [], [], [], 0.0, 0
    for r in rows:
        t += r.get("time/step_s", 0.0)
        n += per_draw * int(r.get("rollout/draws", 1))
        times.append(t), samples.append(n), acc.append(r["accuracy/mean"])
    out = {"time_s": times, "samples": samples, "accuracy": acc, **curve_metrics(times, acc),
           "pg_loss": [r.get("actor/pg_loss") for r in rows]}
    k = max(1, math.ceil(0.2 * len(rows)))
    if any("fipo/weight_max" in r for r in rows):
        out["fipo_spread"] = _mean([r["fipo/weight_max"] - r["fipo/weight_min"]
                                    for r in rows if "fipo/weight_max" in r])
        out["fipo_weight_mean"] = _mean([r.get("fipo/weight_mean") for r in rows])
        if all("fipo/weight_std" in r for r in rows if "fipo/weight_max" in r):  # logged since the tau sweep
            out["fipo_std"] = _mean([r["fipo/weight_std"] for r in rows if "fipo/weight_std" in r])
        out["fipo_at_high_first20"] = _mean([r.get("fipo/frac_at_high") for r in rows[:k]])
        out["fipo_at_high_last20"] = _mean([r.get("fipo/frac_at_high") for r in rows[-k:]])
    if any(FIPO_FIRST_MB in r for r in rows):
        out["fipo_first_mb_dev"] = max(r[FIPO_FIRST_MB] for r in rows if FIPO_FIRST_MB in r)
    for key in GATE_KEYS:
        if any(key in r for r in rows):
            out[key] = _mean([r.get(key) for r in rows])
    return out


def build(out: Path, *, tasks, methods, seeds) -> dict:
    """Collect every cell of ``out/cells`` into the report dict (what ``results.json`` holds)."""
    report = {"tasks": {}, "methods": list(methods), "seeds": list(seeds)}
    for task in tasks:
        cells, failed = {}, {}
        for m in methods:
            cells[m] = {}
            for s in seeds:
                d = out / "cells" / task / slug(m) / f"seed_{s}"
                try:
                    info = json.loads((d / "cell.json").read_text())
                except (OSError, ValueError):
                    info = {"status": "missing"}
                if info["status"] == "ok":
                    cells[m][s] = {**info, **cell_summary(d / "run")}
                else:
                    failed.setdefault(m, {})[s] = info
        table = {}
        for m in methods:
            by_seed = {mt: {s: c[mt] for s, c in cells[m].items()} for mt in METRICS}
            row = {mt: vars(mean_interval(list(by_seed[mt].values()))) for mt in METRICS}
            if BASELINE in cells and m != BASELINE:
                base = {mt: {s: c[mt] for s, c in cells[BASELINE].items()} for mt in METRICS}
                row["diff"] = {mt: vars(paired_interval(by_seed[mt], base[mt])) for mt in METRICS}
            row["params"] = method_overrides(m)
            table[m] = row
        report["tasks"][task] = {"cells": {m: {str(s): c for s, c in v.items()} for m, v in cells.items()},
                                 "failed": {m: {str(s): c for s, c in v.items()} for m, v in failed.items()},
                                 "table": table, "checks": checks(cells, methods)}
    return report


def _params(method: str) -> tuple[str, dict]:
    ov = method_overrides(method)
    return ov[0].split("=", 1)[1], dict(o[len("algorithm.params."):].split("=", 1) for o in ov[1:])


def checks(cells: dict, methods) -> list[str]:
    """The mechanism checks (lines of text) that the methods which ran allow."""
    lines = []
    parsed = {m: _params(m) for m in methods if cells.get(m)}
    fipo = sorted(((float(p.get("tau", 32)), m) for m, (a, p) in parsed.items() if a == "fipo"))
    if fipo:
        devs = [c["fipo_first_mb_dev"] for _, m in fipo for c in cells[m].values() if "fipo_first_mb_dev" in c]
        if devs:
            lines.append(f"FIPO, first mini-batch weights exactly 1: {'yes' if max(devs) == 0 else 'NO'} "
                         f"(max |f - 1| {max(devs):.3g} over every iteration of {len(devs)} cells)")
        else:
            lines.append("FIPO, first mini-batch weights exactly 1: not checked (the trainer logs FIPO weights "
                         f"over all mini-batches of an iteration; needs {FIPO_FIRST_MB})")
        by_tau = []
        for tau, m in fipo:
            cs = list(cells[m].values())
            spread = mean_interval([c.get("fipo_spread", math.nan) for c in cs])
            std = mean_interval([c.get("fipo_std", math.nan) for c in cs])
            by_tau.append({"tau": tau, "std": std.mean if all("fipo_std" in c for c in cs) else None,
                           "mean": _mean([c.get("fipo_weight_mean") for c in cs]),
                           "high": _mean([c.get("fipo_at_high_last20") for c in cs])})
            lines.append(f"FIPO tau={tau:g} ({m}): weight std per iteration "
                         f"{std.fmt() if by_tau[-1]['std'] is not None else 'not logged'}, max-min {spread.fmt()}, "
                         f"mean weight {by_tau[-1]['mean']:.4f}, frac at upper clip "
                         f"first 20% {_mean([c.get('fipo_at_high_first20') for c in cs]):.4f} -> last 20% "
                         f"{by_tau[-1]['high']:.4f}")
        if len(fipo) > 1:
            lines.append(spread_check(by_tau))
    comp = {m: p for m, (a, p) in parsed.items() if a == "comppo"}
    for m in comp:
        stats = [f"{k.split('/')[1]} {mean_interval([c.get(k, math.nan) for c in cells[m].values()]).fmt()} "
                 f"(paper {PAPER_GATES[k]})" for k in GATE_KEYS]
        if any(k in c for c in cells[m].values() for k in GATE_KEYS):
            lines.append(f"CompPO gates ({m}): " + "; ".join(stats))
    lines += _factorial(cells, comp) + _controls(cells, comp) + _ppo_equiv(cells, comp)
    return lines


def spread_check(by_tau: list[dict]) -> str:
    """Does the spread of FIPO's weights grow with tau? Strictly, tau by tau (``by_tau`` sorted by tau).

    The spread is the per-iteration std of the weights (``fipo/weight_std``). Cells run before that metric
    existed fall back to the mean weight and the last-20% fraction at the upper clip, said so. The max-min
    range is not used: with a few thousand tokens per iteration it is the whole clip range for every tau.

    >>> spread_check([{"tau": 4, "std": 0.02}, {"tau": 32, "std": 0.03}, {"tau": 128, "std": 0.03}])
    'FIPO weight spread grows with tau (std per iteration, strictly): NO (tau 4: 0.0200, 32: 0.0300, 128: 0.0300)'
    >>> spread_check([{"tau": 4, "std": None, "mean": 1.01, "high": 0.04}, {"tau": 32, "std": 0.03, "mean": 1.02,
    ...               "high": 0.08}])  # doctest: +NORMALIZE_WHITESPACE
    'FIPO weight spread grows with tau: std not logged by every cell; mean weight, strictly: yes
    (tau 4: 1.0100, 32: 1.0200); frac at upper clip (last 20%), strictly: yes (tau 4: 0.0400, 32: 0.0800)'
    """
    def verdict(key: str) -> str:
        xs = [d[key] for d in by_tau]
        grows = all(a < b for a, b in zip(xs, xs[1:]))
        return f"{'yes' if grows else 'NO'} (tau " + ", ".join(f"{d['tau']:g}: {d[key]:.4f}" for d in by_tau) + ")"

    if all(d["std"] is not None for d in by_tau):
        return f"FIPO weight spread grows with tau (std per iteration, strictly): {verdict('std')}"
    return ("FIPO weight spread grows with tau: std not logged by every cell; mean weight, strictly: "
            f"{verdict('mean')}; frac at upper clip (last 20%), strictly: {verdict('high')}")


def _cell_of(comp: dict, gate: str, critic: str):
    for m, p in comp.items():
        rest = {k: v for k, v in p.items() if k not in ("gate_control", "critic")}
        if not rest and p.get("gate_control", "dynamic") == gate and p.get("critic", "tac") == critic:
            return m
    return None


def _factorial(cells, comp) -> list[str]:
    names = [_cell_of(comp, g, c) for g, c in (("dynamic", "tac"), ("fixed", "tac"), ("dynamic", "standard"),
                                              ("fixed", "standard"))]
    if None in names:
        return []
    out = []
    for mt in METRICS:
        iv = interaction_interval([{s: c[mt] for s, c in cells[m].items()} for m in names])
        out.append(f"CompPO 2x2 gate {{dynamic, fixed}} x critic {{tac, standard}}, interaction on {mt}: {iv.fmt()}"
                   f"{' (excludes 0)' if iv.excludes_zero() else ''}")
    return out


def _controls(cells, comp) -> list[str]:
    base = _cell_of(comp, "dynamic", "tac")
    out = []
    for ctl in ("shuffle", "position"):
        m = _cell_of(comp, ctl, "tac")
        if base and m:
            iv = paired_interval({s: c["last20"] for s, c in cells[m].items()},
                                 {s: c["last20"] for s, c in cells[base].items()})
            out.append(f"CompPO {ctl} control minus dynamic gate, last-20% accuracy: {iv.fmt()}")
    return out


def _ppo_equiv(cells, comp) -> list[str]:
    m = next((m for m, p in comp.items() if p.get("gate_control") == "fixed" and p.get("fixed_gate") == "1.0"), None)
    if m is None or not cells.get("ppo"):
        return []
    diffs = []
    for s in sorted(set(cells[m]) & set(cells["ppo"])):
        a, b = cells[m][s], cells["ppo"][s]
        k = min(len(a["accuracy"]), len(b["accuracy"]))
        d = [abs(x - y) for x, y in zip(a["accuracy"][:k] + a["pg_loss"][:k], b["accuracy"][:k] + b["pg_loss"][:k])
             if x is not None and y is not None]
        diffs.append((s, k, max(d) if d else math.nan))
    same = all(d == 0 for _, _, d in diffs)
    return [f"constant gate = gamma ({m}) vs ppo: {'bit-identical' if same else 'DIFFERENT'} over common iterations "
            f"(seed: iterations, max |diff| of accuracy and pg_loss: "
            + ", ".join(f"{s}: {k}, {d:.3g}" for s, k, d in diffs) + ")"]


def _smooth(xs: list[float]) -> list[float]:
    """Trailing mean over 10% of the curve's iterations (per-iteration accuracy is a few hundred samples).

    >>> _smooth([0.0] * 9 + [1.0] * 11)[-3:]
    [1.0, 1.0, 1.0]
    """
    w = max(1, len(xs) // 10)
    return [sum(xs[max(0, i - w + 1): i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]


def plot(out: Path, report: dict) -> list[str]:
    """One PNG per task: accuracy vs wall time and vs samples, mean and 95% band over seeds per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, t in report["tasks"].items():
        ran = [m for m, by_seed in t["cells"].items() if by_seed]
        # One colour per method (tab20 past 10 methods), variants ("name:variant") dashed; the legend
        # beside the axes so that it hides no curve.
        cmap = plt.get_cmap("tab10" if len(ran) <= 10 else "tab20")
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
        for ax, xkey, label in ((axes[0], "time_s", "wall time of RL iterations (s)"),
                                (axes[1], "samples", "samples generated")):
            for j, m in enumerate(ran):
                curves = list(t["cells"][m].values())
                end = max(c[xkey][-1] for c in curves if c[xkey])
                grid = [end * i / 100 for i in range(101)]
                ys = [interpolate(c[xkey], _smooth(c["accuracy"]), grid) for c in curves]
                ivs = [mean_interval([y[i] for y in ys]) for i in range(len(grid))]
                ax.plot(grid, [iv.mean for iv in ivs], label=f"{m} (n={len(curves)})", color=cmap(j % cmap.N),
                        linestyle="--" if ":" in m else "-")
                ax.fill_between(grid, [iv.lo for iv in ivs], [iv.hi for iv in ivs], color=cmap(j % cmap.N),
                                alpha=0.2 if len(ran) <= 5 else 0.1)
            ax.set_xlabel(label)
            ax.set_ylabel("sampled accuracy")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=8)
        fig.suptitle(f"{task}: sampled accuracy (trailing mean over 10% of iterations), mean and 95% "
                     "t-interval over seeds", fontsize=10)
        fig.tight_layout(rect=(0, 0, 0.8, 1))
        path = out / f"{task}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    return written


def markdown(report: dict, *, plots_rel: str = ".") -> str:
    """The table(s) and checks as Markdown."""
    lines = []
    for task, t in report["tasks"].items():
        lines += [f"### {task}", "", "| method | seeds ok | final acc | last-20% acc | AUC | final - GRPO | "
                  "last-20% - GRPO | AUC - GRPO |", "|---|---|---|---|---|---|---|---|"]
        for m, row in t["table"].items():
            if row["final"]["n"] == 0 and _all_missing(t, m):  # not run on this task (no failure either)
                continue
            fmt = [Interval(**row[mt]).fmt() for mt in METRICS]
            diff = [Interval(**row["diff"][mt]).fmt() for mt in METRICS] if "diff" in row else ["-"] * 3
            n_fail = sum(info["status"] != "missing" for info in t["failed"].get(m, {}).values())
            lines.append(f"| {m} | {row['final']['n']}{f' ({n_fail} failed)' if n_fail else ''} | "
                         + " | ".join(fmt + diff) + " |")
        lines += ["", "Mean and two-sided 95% Student-t interval over seeds; differences are seed-matched "
                  "(paired). AUC: the time-averaged sampled accuracy over the cell's budget.", ""]
        if t["checks"]:
            lines += ["Mechanism checks:", ""] + [f"- {c}" for c in t["checks"]] + [""]
        for m, f in t["failed"].items():
            missing = [s for s, info in f.items() if info["status"] == "missing"]
            if missing:
                lines.append(f"- not run: {m} seed{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
            for s, info in f.items():
                if info["status"] == "missing":
                    continue
                err = (info.get("error") or info["status"]).strip().splitlines()
                lines.append(f"- failed: {m} seed {s}: {err[-1] if err else info['status']}")
        lines += ["", f"![{task}]({plots_rel}/{task}.png)", ""]
    return "\n".join(lines)


def _all_missing(task: dict, method: str) -> bool:
    return all(info["status"] == "missing" for info in task["failed"].get(method, {}).values())


def write(out: Path, report: dict, *, doc: str | None) -> None:
    """``results.json``, ``results.md``, the plots, and the regenerated ``doc`` (if given)."""
    try:
        report["plots"] = plot(out, report)
    except ImportError:
        report["plots"] = []
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "results.md").write_text(markdown(report) + "\n")
    if doc:
        body = ["# Credit testbed results", "", "Regenerated by `tools/credit_testbed.py` (do not edit by hand).", "",
                "```bash", report.get("command", ""), "```", "",
                f"Wall time of this invocation {report.get('wall_s', math.nan):.0f} s (cells finished by earlier "
                f"invocations are reused); the cells' own wall time {_cells_wall(report):.0f} s in all; budget "
                f"{report.get('budget_s')} s of RL per cell; {report.get('jobs')} cells at a time; seeds "
                f"{report['seeds']}.", "", *([report["note"], ""] if report.get("note") else []),
                markdown(report, plots_rel=".")]
        Path(doc).parent.mkdir(parents=True, exist_ok=True)
        for png in report["plots"]:  # next to the document, which is committed (the run directory is not)
            src, dst = out / Path(png).name, Path(doc).parent / Path(png).name
            if src.resolve() != dst.resolve():
                shutil.copyfile(src, dst)
        Path(doc).write_text("\n".join(body) + "\n")


def _cells_wall(report: dict) -> float:
    return sum(c.get("wall_s", 0.0) for t in report["tasks"].values() for by_seed in t["cells"].values()
               for c in by_seed.values())
