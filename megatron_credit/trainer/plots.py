"""PNG plots of a run's ``metrics.jsonl`` that a person reads without the README.

Every figure has a title naming the run (its directory) and the algorithm (from the run's
``config.yaml``), one quantity per panel with its unit on the y axis, the x axis in RL iterations, and
legends in words (:data:`PLOTS`). Quantities of different units or scales never share an axis: reward
and accuracy, or FIPO's weights (~1.0-1.2) and the fraction of tokens at the weights' upper clip
(~0.02), are separate panels over the same iterations.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional


@dataclasses.dataclass(frozen=True)
class Panel:
    """One y axis: a quantity with its unit, and the metrics drawn on it as ``(key, legend label)``."""

    ylabel: str
    """The quantity and its unit in parentheses, e.g. ``"accuracy (fraction correct)"``."""
    lines: tuple[tuple[str, str], ...]
    ylim: Optional[tuple[float, float]] = None
    """Fixed limits for bounded quantities (fractions); None: matplotlib's."""


@dataclasses.dataclass(frozen=True)
class Plot:
    """One PNG ``plots/<name>.png``: a title and panels stacked over a shared iteration axis."""

    name: str
    title: str
    panels: tuple[Panel, ...]


_FRACTION = (-0.02, 1.02)
PLOTS: tuple[Plot, ...] = (
    Plot("reward", "reward and accuracy", (
        Panel("reward (mean per response)", (("reward/mean", "reward of the training samples"),)),
        Panel("accuracy (fraction correct)", (("accuracy/mean", "sampled, training prompts"),
                                              ("val/accuracy", "validation prompts")), _FRACTION))),
    Plot("length", "response length", (
        Panel("length (tokens)", (("response_length/mean", "mean response length"),)),)),
    Plot("entropy", "policy entropy", (
        Panel("entropy (nats per token)", (("actor/entropy", "mean over response tokens"),)),)),
    Plot("kl", "KL divergences", (
        Panel("KL (nats per token)", (("actor/ppo_kl", "policy vs behaviour policy"),
                                      ("actor/kl_ref", "policy vs frozen reference"))),)),
    Plot("clip", "clipped tokens", (
        Panel("clipped tokens (fraction)", (("actor/clipfrac_high", "ratio above 1 + clip_high"),
                                     ("actor/clipfrac_low", "ratio below 1 - clip_low"),
                                     ("actor/clipfrac_dual", "dual clip (A < 0, ratio > c)"))),)),
    Plot("grad_norm", "policy gradient norm", (
        Panel("gradient norm (L2)", (("actor/grad_norm", "policy, mean per optimizer step"),)),)),
    Plot("fipo_weights", "FIPO future-KL weights", (
        Panel("weight f_t (dimensionless)", (("fipo/weight_max", "max over tokens"),
                                              ("fipo/weight_mean", "mean over tokens"),
                                              ("fipo/weight_min", "min over tokens"))),
        Panel("tokens (fraction)", (("fipo/frac_at_high", "weight at the upper clip"),)))),
    Plot("critic", "critic", (
        Panel("value loss (squared error)", (("critic/value_loss", "value loss"),)),
        Panel("explained variance (fraction)", (("critic/explained_var", "share of return variance the values explain"),)))),
)


def run_title(run_dir: str) -> str:
    """``"<run directory name> (<algorithm>)"``; the algorithm from ``config.yaml`` when it is there."""
    name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            algorithm = (yaml.safe_load(f) or {}).get("algorithm", {}).get("name")
    except (OSError, ValueError, AttributeError):
        algorithm = None
    return f"{name} ({algorithm})" if algorithm else name


def plot_metrics(run_dir: str, plots: Iterable[Plot] = PLOTS) -> list[str]:
    """PNG plots of ``run_dir/metrics.jsonl`` in ``run_dir/plots``; returns the files written. A plot
    with no data is skipped, and so is a panel whose metrics are all absent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_credit.metrics.writer import read_metrics

    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    os.makedirs(os.path.join(run_dir, "plots"), exist_ok=True)
    title, written = run_title(run_dir), []
    for plot in plots:
        panels = []
        for panel in plot.panels:
            series = [(label, [(r["step"], r[k]) for r in rows if r.get(k) is not None]) for k, label in panel.lines]
            series = [(label, pts) for label, pts in series if pts]
            if series:
                panels.append((panel, series))
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(6.4, 1.1 + 2.5 * len(panels)), sharex=True, squeeze=False)
        for ax, (panel, series) in zip(axes[:, 0], panels):
            for label, pts in series:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="." if len(pts) < 40 else None)
            ax.set_ylabel(panel.ylabel, fontsize=9)
            if panel.ylim is not None:
                ax.set_ylim(*panel.ylim)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
        axes[-1, 0].set_xlabel("RL iteration")
        fig.suptitle(f"{title}: {plot.title}", fontsize=11)
        fig.tight_layout()
        path = os.path.join(run_dir, "plots", f"{plot.name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
