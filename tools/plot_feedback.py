"""The feedback demo's curves (``examples/reasoning_gym_feedback_tiny_cpu.yaml``, docs/multi_turn.md):

    python tools/plot_feedback.py OUT.png RUN_DIR[=LABEL] ...

Left: sampled accuracy per iteration at the first attempt (``accuracy/first_turn``, dashed) and after the
feedback (``accuracy/mean``, the last attempt's verdict, solid), validation accuracy after feedback (markers);
middle: attempts per trajectory (``rollout/turns_mean``); right: the mean |advantage| the loss applied to each
attempt's tokens (``advantage/turn_<k>_abs_mean``; attempt 1 solid, 2 dashed, 3 dotted). Prints one line per
run: the first and last iteration's first-attempt and final accuracy, and the last validation.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.plot_rollout_modes import labelled_runs, runs_arguments  # noqa: E402


def summary(label: str, rows: list[dict]) -> str:
    """One run's line: first and last iteration's first-attempt and final accuracy, the last validation.

    >>> summary("fipo", [{"accuracy/first_turn": 0.25, "accuracy/mean": 0.5},
    ...                  {"accuracy/first_turn": 0.75, "accuracy/mean": 0.875, "val/accuracy": 0.9}])
    'fipo: first attempt 0.250 -> 0.750, after feedback 0.500 -> 0.875, validation 0.900'
    """
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return (f"{label}: first attempt {rows[0]['accuracy/first_turn']:.3f} -> {rows[-1]['accuracy/first_turn']:.3f}, "
            f"after feedback {rows[0]['accuracy/mean']:.3f} -> {rows[-1]['accuracy/mean']:.3f}, "
            f"validation {val[-1] if val else float('nan'):.3f}")


def main(argv=None) -> int:
    args = runs_arguments(__doc__, argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, turns, credit) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
    for i, (label, rows) in enumerate(labelled_runs(args.runs)):
        colour = f"C{i}"
        steps = [r["step"] for r in rows]
        acc.plot(steps, [r["accuracy/mean"] for r in rows], color=colour, lw=1.2, label=f"{label} after feedback")
        acc.plot(steps, [r["accuracy/first_turn"] for r in rows], "--", color=colour, lw=1.2,
                 label=f"{label} first attempt")
        val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
        if val:
            acc.plot(*zip(*val), "o", color=colour, label=f"{label} validation")
        turns.plot(steps, [r["rollout/turns_mean"] for r in rows], color=colour, label=label)
        for k, style in ((0, "-"), (1, "--"), (2, ":")):
            credit.plot(steps, [r.get(f"advantage/turn_{k}_abs_mean", float("nan")) for r in rows], style,
                        color=colour, label=f"{label} attempt {k + 1}")
        print(summary(label, rows))
    acc.set(xlabel="iteration", ylabel="sampled accuracy", ylim=(0, 1.02), title="accuracy")
    turns.set(xlabel="iteration", ylabel="attempts per trajectory", title="attempts")
    credit.set(xlabel="iteration", ylabel="mean |A| applied", title="credit per attempt")
    for ax in (acc, turns, credit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(args.out, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
