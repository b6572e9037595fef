"""Metric tables: how reduced ``sum:`` / ``min:`` / ``max:`` statistics become the documented metrics.

The trainer's own metrics (``actor/``, ``mismatch/``) are :data:`CORE`; an algorithm declares the tables
of what it adds (``fipo/``, ``critic/``, ``comppo/``) in its registration (``AlgorithmSpec.metrics``), so
``trainer/metrics.finalize`` names no algorithm. Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True, kw_only=True)
class MetricTable:
    """One group of metrics computed from the reduced statistics of an iteration."""

    means: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """metric -> (numerator, denominator): a token- or step-weighted mean ``sum:x / sum:n``."""
    extremes: Mapping[str, str] = field(default_factory=dict)
    """metric -> a ``min:`` / ``max:`` statistic, reported where it is finite."""
    derived: tuple[Callable[[Mapping[str, Any]], dict[str, float]], ...] = ()
    """Functions of the reduced statistics (tensors by key) returning further metrics."""


def _skipped(v: Mapping[str, Any]) -> dict[str, float]:
    return {"actor/skipped_steps": float(v["sum:skipped_steps"])} if "sum:skipped_steps" in v else {}


CORE = MetricTable(means={
    "actor/pg_loss": ("sum:pg_loss", "sum:opt_steps"),
    "actor/entropy": ("sum:entropy", "sum:tokens"),
    "actor/ppo_kl": ("sum:approx_kl", "sum:tokens"),
    "actor/clipfrac_high": ("sum:clipfrac_high", "sum:tokens"),
    "actor/clipfrac_low": ("sum:clipfrac_low", "sum:tokens"),
    "actor/clipfrac_dual": ("sum:clipfrac_dual", "sum:tokens"),
    "actor/logp_diff_abs": ("sum:logp_diff", "sum:tokens"),
    "actor/kl_ref": ("sum:kl", "sum:tokens"),
    "actor/grad_norm": ("sum:grad_norm", "sum:opt_steps"),
    "mismatch/logprob_abs_mean": ("sum:mismatch_abs", "sum:mismatch_tokens"),
    "mismatch/tis_weight_mean": ("sum:tis_mean_weight", "sum:tokens"),
    "mismatch/tis_capped_frac": ("sum:tis_capped_frac", "sum:tokens"),
    # what the update's forward passes compute beyond the sequences' own tokens (padding rows, alignment)
    "throughput/padding_fraction": ("sum:padding_tokens", "sum:computed_tokens"),
}, derived=(_skipped,))
"""The trainer's own metrics, whatever the algorithm."""


def _fipo_derived(v: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    lo, hi = v.get("min:first_minibatch/fipo_weight/min"), v.get("max:first_minibatch/fipo_weight/max")
    if lo is not None and hi is not None and math.isfinite(float(lo)) and math.isfinite(float(hi)):
        out["fipo/first_minibatch_max_abs_dev"] = max(float(hi) - 1.0, 1.0 - float(lo))  # on-policy: 0
    if "sum:fipo_weight/dev_sq" in v and "sum:fipo_weight/mean" in v:
        n = v["sum:tokens"].clamp(min=1e-12)  # std of the weights over every valid token
        var = v["sum:fipo_weight/dev_sq"] / n - (v["sum:fipo_weight/mean"] / n - 1) ** 2
        out["fipo/weight_std"] = math.sqrt(max(float(var), 0.0))
    return out


FIPO = MetricTable(means={
    "fipo/weight_mean": ("sum:fipo_weight/mean", "sum:tokens"),
    "fipo/frac_at_high": ("sum:fipo_weight/frac_at_high", "sum:tokens"),
    "fipo/frac_dual_masked": ("sum:fipo_weight/frac_dual_masked", "sum:tokens"),
}, extremes={"fipo/weight_min": "min:fipo_weight/min", "fipo/weight_max": "max:fipo_weight/max"},
    derived=(_fipo_derived,))
"""FIPO's Future-KL weights (``losses.policy.fipo_policy_loss``)."""


def _critic_derived(v: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    if "sum:critic_skipped_steps" in v:  # a separate critic's own optimizer
        out["critic/skipped_steps"] = float(v["sum:critic_skipped_steps"])
    if "sum:ret" in v:
        n = v["sum:tokens"].clamp(min=1)
        var = lambda s, s2: s2 / n - (s / n) ** 2  # noqa: E731
        v_ret = var(v["sum:ret"], v["sum:ret2"])
        v_res = var(v["sum:resid"], v["sum:resid2"])
        out["critic/explained_var"] = float(1 - v_res / v_ret.clamp(min=1e-12))
    return out


CRITIC = MetricTable(means={
    "critic/value_loss": ("sum:value_loss", "sum:opt_steps"),
    "critic/grad_norm": ("sum:critic_grad_norm", "sum:opt_steps"),
}, derived=(_critic_derived,))
"""A critic's value loss, gradient norm and explained variance (``losses.value``)."""

GATES = MetricTable(means={
    "comppo/gate_mean": ("sum:gate", "sum:gate_tokens"),
    "comppo/transport_mean": ("sum:transport", "sum:gate_tokens"),
    "comppo/gate_first_third": ("sum:gate_first", "sum:gate_first_tokens"),
    "comppo/gate_mid_third": ("sum:gate_mid", "sum:gate_mid_tokens"),
    "comppo/gate_last_third": ("sum:gate_last", "sum:gate_last_tokens"),
})
"""CompPO's transport gates (``trainer/controls.gate_stats``)."""

BUILT_IN = (FIPO, CRITIC, GATES)
"""The built-in algorithms' tables: what ``finalize`` computes when it is not told an algorithm's."""
