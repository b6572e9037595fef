"""Plots a person reads without the README: a title with the run and the algorithm, labelled
axes with units, one quantity per axis, legends in words."""
from __future__ import annotations

import matplotlib.figure
import pytest
import yaml

from megatron_credit.metrics.writer import MetricsWriter
from megatron_credit.trainer.plots import PLOTS, plot_metrics, run_title


@pytest.fixture
def captured(monkeypatch):
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    return figures


def _run(tmp_path, name="demo_cpu", algorithm="fipo"):
    run = tmp_path / name
    run.mkdir()
    if algorithm:
        (run / "config.yaml").write_text(yaml.safe_dump({"seed": 1, "algorithm": {"name": algorithm}}))
    w = MetricsWriter(str(run), resume_step=None, tensorboard=False, wandb_project=None, config={})
    every = {k for p in PLOTS for panel in p.panels for k, _ in panel.lines}
    for step in range(1, 6):
        w.write(step, {k: 0.01 * step + 1.0 for k in sorted(every)} | {"fipo/frac_at_high": 0.02,
                                                                         "accuracy/mean": 0.1 * step})
    w.close()
    return run


def test_every_plot_has_a_title_labelled_axes_and_words_in_its_legend(tmp_path, captured):
    run = _run(tmp_path)
    written = plot_metrics(str(run))
    assert [p.rsplit("/", 1)[-1] for p in written] == [f"{p.name}.png" for p in PLOTS]
    keys = {k for p in PLOTS for panel in p.panels for k, _ in panel.lines}
    for plot, fig in zip(PLOTS, captured):
        assert fig._suptitle.get_text() == f"demo_cpu (fipo): {plot.title}"
        assert len(fig.axes) == len(plot.panels)
        for ax, panel in zip(fig.axes, plot.panels):
            assert ax.get_ylabel() == panel.ylabel and panel.ylabel.endswith(")") and " (" in panel.ylabel  # a unit
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            assert legend == [label for _, label in panel.lines] and not set(legend) & keys  # no raw metric keys
        assert fig.axes[-1].get_xlabel() == "RL iteration"


def test_quantities_of_different_scales_never_share_an_axis(tmp_path, captured):
    plot_metrics(str(_run(tmp_path)))
    by_name = dict(zip([p.name for p in PLOTS], captured))
    reward, accuracy = by_name["reward"].axes
    assert [ln.get_label() for ln in reward.lines] == ["reward of the training samples"]
    assert [ln.get_label() for ln in accuracy.lines] == ["sampled, training prompts", "validation prompts"]
    assert list(accuracy.lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    weights, at_high = by_name["fipo_weights"].axes
    assert [ln.get_label() for ln in weights.lines] == ["max over tokens", "mean over tokens", "min over tokens"]
    assert [ln.get_label() for ln in at_high.lines] == ["weight at the upper clip"]
    assert list(at_high.lines[0].get_ydata()) == [0.02] * 5
    assert at_high.get_ylabel() == "tokens (fraction)" and weights.get_ylabel() == "weight f_t (dimensionless)"


def test_the_title_names_the_run_and_without_a_config_only_the_run(tmp_path):
    assert run_title(str(_run(tmp_path, "a", "comppo"))) == "a (comppo)"
    assert run_title(str(_run(tmp_path, "b", None)) + "/") == "b"
