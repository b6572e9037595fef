"""The multi-turn demo's curves (``examples/tool_calc_cpu.yaml``, docs/multi_turn.md):

    python tools/plot_tool_calc.py OUT.png RUN_DIR[=LABEL] ...

Left: sampled accuracy per iteration (lines) and validation accuracy (markers); middle: tool calls per
trajectory (``rollout/tool_calls_mean``); right: the mean |advantage| the loss applied to each turn's action
tokens (``advantage/turn_<k>_abs_mean``, turn 0 solid, turn 1 dashed). Prints one line per run: first and last
accuracy and tool calls, and the last validation.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.plot_rollout_modes import labelled_runs, runs_arguments  # noqa: E402


def main(argv=None) -> int:
    args = runs_arguments(__doc__, argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, calls, credit) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    for i, (label, rows) in enumerate(labelled_runs(args.runs)):
        colour = f"C{i}"
        steps = [r["step"] for r in rows]
        acc.plot(steps, [r["accuracy/mean"] for r in rows], color=colour, lw=1, label=f"{label} sampled")
        val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        if val:
            acc.plot(*zip(*val), "o", color=colour, label=f"{label} validation")
        calls.plot(steps, [r.get("rollout/tool_calls_mean", float("nan")) for r in rows], color=colour, label=label)
        for k, style in ((0, "-"), (1, "--")):
            credit.plot(steps, [r.get(f"advantage/turn_{k}_abs_mean", float("nan")) for r in rows], style,
                        color=colour, label=f"{label} turn {k}")
        last_val = val[-1][1] if val else float("nan")
        print(f"{label}: accuracy {rows[0]['accuracy/mean']:.3f} -> {rows[-1]['accuracy/mean']:.3f}, tool calls "
              f"{rows[0].get('rollout/tool_calls_mean', float('nan')):.2f} -> "
              f"{rows[-1].get('rollout/tool_calls_mean', float('nan')):.2f}, validation {last_val:.3f}")
    acc.set(xlabel="iteration", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    calls.set(xlabel="iteration", ylabel="calls per trajectory", title="tool calls")
    credit.set(xlabel="iteration", ylabel="mean |A| applied", title="credit per turn")
    for ax in (acc, calls, credit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(args.out, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
