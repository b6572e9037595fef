"""Truncated importance sampling of the rollout engine vs the trainer (a pure tensor function).

The engine samples from pi_engine, the trainer's old log-probs are pi_old (``rollout/mismatch.py`` logs
the difference). :func:`truncated_is_weights` corrects it with ``w_t = min(pi_old / pi_engine, C)``
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"), applied as
a detached per-token factor on the policy loss (``is_weights`` of ``losses/policy.py``).
"""
from __future__ import annotations

import math

import torch


def truncated_is_weights(
    trainer_old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token truncated importance weights ``min(exp(old - rollout), cap)``, zero off the mask.

    trainer_old_logp, rollout_logp, mask: [B, T]. cap > 0 (typically 2). The exponent is clamped at
    log(cap) before exp, which gives exactly min(ratio, cap) without ever forming inf.
    Returns (weights [B, T] detached, metrics) with metrics ``tis_mean_weight`` [] (token-mean of the
    weights) and ``tis_capped_frac`` [] (fraction of tokens whose ratio exceeded cap).

    >>> w, m = truncated_is_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-2.0, 0.0]]),
    ...                             torch.tensor([[True, True]]), cap=2.0)
    >>> w.tolist(), float(m["tis_capped_frac"])
    ([[2.0, 1.0]], 0.5)
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    valid = mask.bool()
    m = valid.to(trainer_old_logp.dtype)
    log_ratio = (trainer_old_logp - rollout_logp).detach()
    log_cap = math.log(cap)
    # Masked by selection: padding may hold NaN / inf log-probs, and exp(NaN) * 0 is NaN.
    weights = torch.where(valid, torch.exp(log_ratio.clamp(max=log_cap)), 0.0)
    total = m.sum().clamp_min(1.0)
    capped = (valid & (log_ratio > log_cap)).to(m.dtype)
    return weights, {"tis_mean_weight": weights.sum() / total, "tis_capped_frac": capped.sum() / total}
