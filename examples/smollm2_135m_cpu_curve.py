"""The curve of examples/smollm2_135m_cpu.sh runs: sampled accuracy against minutes of RL, one line per
run (the training samples of each iteration, their 3-iteration running mean, and the validations).

    python examples/smollm2_135m_cpu_curve.py OUT.png RUN_DIR [RUN_DIR ...]

Prints the table the README shows (iteration, minute, accuracy, running mean, validation, KL).
"""
from __future__ import annotations

import json
import os
import sys


def rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        out, t = [], 0.0
        for line in f:
            r = json.loads(line)
            t += r.get("time/step_s", 0.0)
            out.append({"step": r["step"], "min": t / 60, "acc": r["accuracy/mean"], "val": r.get("val/accuracy"),
                        "kl": r.get("actor/kl_ref", 0.0)})
    for i, r in enumerate(out):
        window = out[max(0, i - 2): i + 1]
        r["mean3"] = sum(w["acc"] for w in window) / len(window)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in argv[1:]:
        rs = rows(run)
        name = os.path.basename(run.rstrip("/"))
        print(f"{name}: iteration, minute, accuracy, mean of 3, validation, KL")
        for r in rs:
            val = "" if r["val"] is None else f"{r['val']:.3f}"
            print(f"  {r['step']:3d} {r['min']:6.1f} {r['acc']:.3f} {r['mean3']:.3f} {val:>6} {r['kl']:.4f}")
        line, = ax.plot([r["min"] for r in rs], [r["mean3"] for r in rs], label=f"{name}: training samples (mean of 3)")
        ax.plot([r["min"] for r in rs], [r["acc"] for r in rs], ".", color=line.get_color(), alpha=0.4)
        v = [r for r in rs if r["val"] is not None]
        ax.plot([r["min"] for r in v], [r["val"] for r in v], "s", color=line.get_color(), label=f"{name}: validation")
    ax.axhline(0.23, ls="--", color="gray", label="base model, sampled (0.23)")
    ax.set_xlabel("minutes of RL (wall clock, 2 cores)")
    ax.set_ylabel("accuracy (fraction correct)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SmolLM2-135M-Instruct, GRPO + KL, one-digit addition")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
