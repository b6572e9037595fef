"""Metric tables: how a loss's statistics are reduced, and how the reduced statistics become the
documented metrics.

A policy loss returns its statistics as rank-local values per micro-batch (``clipfrac_high``: the
micro-batch's mean over its valid tokens; ``fipo_weight/max``: its maximum). A table declares, for each
statistic it owns, how the trainer reduces it over micro-batches, mini-batches and ranks
(:attr:`MetricTable.reduce`: a mean over tokens, a sum, a minimum or a maximum), and which
metrics come out of the reduced ``sum:`` / ``min:`` / ``max:`` values. A statistic no table declares is
refused by the trainer in one line: nothing is computed and then dropped.

The trainer's own metrics (``actor/``, ``mismatch/``, ``credit/``) are :data:`CORE`. The built-in
algorithms' tables (``fipo/``, ``critic/``, ``comppo/``) are declared here too; an algorithm names the tables
it logs as its class's ``metrics`` (``algorithm/base.py``; a plugin algorithm declares its own table in its
own file), so the trainer names no algorithm. Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


TOKEN_MEAN = "token_mean"
"""The micro-batch's mean over its valid tokens; reduced as ``sum:x`` (value x tokens), read over ``sum:tokens``."""
SUM = "sum"
"""Added as it is: ``sum:x``."""
MIN = "min"
"""The smallest over every micro-batch and rank: ``min:x`` (also ``min:first_minibatch/x`` for the first
mini-batch of the iteration). NaN (no valid token) never wins."""
MAX = "max"
"""The largest, as :data:`MIN`: ``max:x`` and ``max:first_minibatch/x``."""
REDUCTIONS = (TOKEN_MEAN, SUM, MIN, MAX)


@dataclass(frozen=True, kw_only=True)
class MetricTable:
    """One group of metrics computed from the reduced statistics of an iteration."""

    means: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """metric -> (numerator, denominator): a token- or step-weighted mean ``sum:x / sum:n``."""
    extremes: Mapping[str, str] = field(default_factory=dict)
    """metric -> a ``min:`` / ``max:`` statistic, reported where it is finite."""
    derived: tuple[Callable[[Mapping[str, Any]], dict[str, float]], ...] = ()
    """Functions of the reduced statistics (tensors by key) returning further metrics."""
    reduce: Mapping[str, str] = field(default_factory=dict)
    """loss statistic -> how it is reduced (one of :data:`REDUCTIONS`)."""

    def __post_init__(self) -> None:
        bad = {k: r for k, r in self.reduce.items() if r not in REDUCTIONS}
        if bad:
            raise ValueError(f"MetricTable.reduce: {bad} (each must be one of {REDUCTIONS})")


def reductions(tables) -> dict[str, str]:
    """Every statistic the ``tables`` declare -> its reduction; a statistic declared twice differently is
    refused."""
    out: dict[str, str] = {}
    for table in tables:
        for k, r in table.reduce.items():
            if out.setdefault(k, r) != r:
                raise ValueError(f"loss statistic {k!r} is reduced as both {out[k]!r} and {r!r}")
    return out


def _skipped(v: Mapping[str, Any]) -> dict[str, float]:
    return {"actor/skipped_steps": float(v["sum:skipped_steps"])} if "sum:skipped_steps" in v else {}


CREDIT_DIAGNOSTICS = ("weight_gini", "effective_token_frac", "position_corr")
"""The ``credit/`` metrics (``credit/diagnostics.credit_sums``), from the sums of the same names without ``weight_`` /
``token_``."""


def _credit(v: Mapping[str, Any]) -> dict[str, float]:
    """``credit/*``: means over the responses with credit (none: no metric, as for an extreme of no token,
    rather than a 0 that would read as "equal credit")."""
    n = v.get("sum:credit/responses")
    if n is None or float(n) <= 0:
        return {}
    sums = ("gini", "effective_frac", "position_corr")
    return {f"credit/{name}": float(v[f"sum:credit/{k}"] / n) for name, k in zip(CREDIT_DIAGNOSTICS, sums)}


def _turns(v: Mapping[str, Any]) -> dict[str, float]:
    """``advantage/turn_<k>_mean`` and ``_abs_mean``: the applied advantages of multi-turn trajectories' action
    tokens per turn index (``credit/diagnostics.turn_sums``), for the turns that have tokens."""
    out = {}
    k = 0
    while f"sum:turn_adv/{k}/tokens" in v:
        n = float(v[f"sum:turn_adv/{k}/tokens"])
        if n > 0:
            out[f"advantage/turn_{k}_mean"] = float(v[f"sum:turn_adv/{k}/sum"]) / n
            out[f"advantage/turn_{k}_abs_mean"] = float(v[f"sum:turn_adv/{k}/abs"]) / n
        k += 1
    return out


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
}, derived=(_skipped, _credit, _turns), reduce={
    # the clipped surrogate's (losses.policy) and the engine-mismatch weights' (losses.importance)
    "clipfrac_low": TOKEN_MEAN, "clipfrac_high": TOKEN_MEAN, "clipfrac_dual": TOKEN_MEAN, "approx_kl": TOKEN_MEAN,
    "tis_mean_weight": TOKEN_MEAN, "tis_capped_frac": TOKEN_MEAN,
})
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
    "fipo/frac_at_low": ("sum:fipo_weight/frac_at_low", "sum:tokens"),
    "fipo/frac_dual_masked": ("sum:fipo_weight/frac_dual_masked", "sum:tokens"),
    "fipo/frac_dual_capped": ("sum:fipo_weight/frac_dual_capped", "sum:tokens"),
}, extremes={"fipo/weight_min": "min:fipo_weight/min", "fipo/weight_max": "max:fipo_weight/max"},
    derived=(_fipo_derived,), reduce={
    **{f"fipo_weight/{k}": TOKEN_MEAN for k in ("mean", "dev_sq", "frac_at_low", "frac_at_high",
                                                  "frac_dual_masked", "frac_dual_capped")},
    "fipo_weight/min": MIN, "fipo_weight/max": MAX,
})
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
"""CompPO's transport gates (``algorithm/comppo.gate_stats``)."""

BUILT_IN = (FIPO, CRITIC, GATES)
"""The built-in algorithms' tables: what ``finalize`` computes when it is not told an algorithm's."""
