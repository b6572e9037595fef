"""Learning curves and staleness of runs side by side (``rollout.mode`` sync / one_step_off / async):

    python tools/plot_rollout_modes.py OUT.png RUN_DIR[=LABEL] ...

Left: the sampled accuracy of each iteration (thin) and the validation accuracy (markers); middle: iteration
time; right: the histogram of every trained sample's staleness over the run (``rollout/staleness_hist/*``).
Prints one line per run: final validation, mean iteration time, hidden fraction and staleness.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def runs_arguments(doc: str, argv=None) -> argparse.Namespace:
    """``OUT.png RUN_DIR[=LABEL] ...``, the command line of the run-comparing plots (``doc``: the tool's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl, each optionally =LABEL")
    return ap.parse_args(argv)


def labelled_runs(specs: list[str]) -> list[tuple[str, list[dict]]]:
    """Each ``RUN_DIR[=LABEL]`` -> its label (the folder's name by default) and its ``metrics.jsonl`` rows; a
    run without one is one ``error:`` line and exit 2."""
    out = []
    for spec in specs:
        run, _, label = spec.partition("=")
        try:
            out.append((label or os.path.basename(os.path.normpath(run)), _rows(run)))
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    return out


def main(argv=None) -> int:
    args = runs_arguments(__doc__, argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, step, hist) = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(args.runs)
    for i, (label, rows) in enumerate(labelled_runs(args.runs)):
        steps = [r["step"] for r in rows]
        line, = acc.plot(steps, [r["accuracy/mean"] for r in rows], lw=0.8, alpha=0.6, label=f"{label} (sampled)")
        val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        acc.plot([s for s, _ in val], [v for _, v in val], "o-", color=line.get_color(), label=f"{label} (validation)")
        step.plot(steps, [r["time/step_s"] for r in rows], lw=0.8, color=line.get_color(), label=label)
        counts: dict[int, float] = {}
        for r in rows:
            for k, v in r.items():
                if k.startswith("rollout/staleness_hist/"):
                    s = int(k.rsplit("/", 1)[1])
                    counts[s] = counts.get(s, 0.0) + v
        total = sum(counts.values()) or 1.0
        xs = sorted(counts)
        hist.bar([x + (i - (len(args.runs) - 1) / 2) * width for x in xs], [counts[x] / total for x in xs], width=width, color=line.get_color(),
                 label=label)
        mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        print(f"{label}: validation {val[-1][1] if val else float('nan'):.3f} at {val[-1][0] if val else '-'}, "
              f"iteration {mean('time/step_s'):.2f} s, hidden {mean('time/rollout_hidden_frac'):.2f}, "
              f"staleness {mean('rollout/staleness_mean'):.2f} (max {max(r['rollout/staleness_max'] for r in rows):g})")
    acc.set(xlabel="iteration", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    acc.legend(fontsize=7)
    step.set(xlabel="iteration", ylabel="seconds", title="iteration time")
    step.legend(fontsize=7)
    hist.set_xticks(sorted({int(t) for t in hist.get_xticks() if t == int(t) and t >= 0}))
    hist.set(xlabel="staleness (policy versions)", ylabel="fraction of trained samples", title="staleness")
    hist.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
