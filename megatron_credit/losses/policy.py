"""Per-token policy-gradient losses: PPO clip (asymmetric, dual clip), GSPO, FIPO-weighted DAPO.

Each function returns ``(per_token_loss [B, T], metrics)``; reduce the loss with :func:`aggregate_loss`
(re-exported here) and global denominators. The clip settings have no defaults here: an algorithm's
config holds them (``algorithm/``: DAPO's 0.2 / 0.28 / 3.0 on ``DAPO.Config``). Metrics are detached means over this rank's valid tokens:
``clipfrac_low`` (A < 0 and ratio < 1 - eps_low), ``clipfrac_high`` (A > 0 and ratio > 1 + eps_high),
``clipfrac_dual`` (A < 0 and ratio > c: the dual clip caps the loss), ``approx_kl`` (the k3 estimator
``(r - 1) - log r`` of KL(old || new)).

PPO/DAPO (docs/architecture.md "DAPO"): ``r = exp(logp - old_logp)`` (log-ratio clamped to [-20, 20] as in the
published code), ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, and for ``A < 0`` the dual clip
``l = min(l, -A c)`` with ``c > 1``. GSPO (Zheng et al. 2025) uses the sequence ratio
``s_i = exp(mean_t (logp - old_logp))`` in its token-level form ``s_it = sg[s_i] pi_t / sg[pi_t]``, whose
value is ``s_i`` and whose gradient with seq-mean-token-mean aggregation equals GSPO's. Truncated
importance sampling (rollout engine vs trainer log-probs) multiplies the per-token loss by the weights
``min(exp(old_logp - rollout_logp), C)`` of :func:`megatron_credit.losses.importance.truncated_is_weights`,
detached.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_credit.credit.future_kl import LOG_RATIO_CLAMP, fipo_weights
from megatron_credit.losses.aggregation import AGG_MODES, AGG_REQUIRED_ARGS, aggregate_loss

__all__ = ["AGG_MODES", "AGG_REQUIRED_ARGS", "aggregate_loss", "fipo_policy_loss", "gspo_loss", "ppo_clip_loss"]

Metrics = dict[str, torch.Tensor]


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, *, clip_low: float, clip_high: float,
                  dual_clip_c: Optional[float],
                  is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate per token, ``[B, T]`` (0 on masked tokens).

    Args:
        logp: ``[B, T]`` current log-probs (with grad); old_logp: ``[B, T]`` behaviour log-probs.
        advantages: ``[B, T]`` (detached). response_mask: ``[B, T]`` bool or 0/1.
        clip_low, clip_high: ``eps_low, eps_high`` of the clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip_c: cap ``-A c`` for negative advantages (``c > 1``); ``None`` disables it.
        is_weights: optional ``[B, T]`` truncated importance weights (detached; the trainer's come from
            :func:`megatron_credit.losses.importance.truncated_is_weights`).
    """
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _clipped_surrogate(log_ratio, advantages, response_mask, clip_low=clip_low,
                              clip_high=clip_high, dual_clip_c=dual_clip_c, is_weights=is_weights)


def _clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                       clip_low: float, clip_high: float, dual_clip_c: Optional[float],
                       is_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
    # Masked positions may hold NaN / inf (padding with logp = old_logp = -inf). Select them away from
    # every input before any arithmetic: masking only the output would leave NaN in the backward pass
    # (where's zero gradient times d exp(NaN) is NaN) and in the metrics.
    valid = response_mask.bool()
    log_ratio = torch.where(valid, log_ratio, 0.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages.detach(), 0.0)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    neg = adv < 0
    if dual_clip_c is not None:
        loss = torch.where(neg, torch.minimum(loss, -adv * dual_clip_c), loss)
    if is_weights is not None:
        loss = loss * torch.where(valid, is_weights.detach(), 0.0)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        dual = neg & (r > dual_clip_c) if dual_clip_c is not None else torch.zeros_like(valid)
        metrics = {
            "clipfrac_low": _masked_mean(neg & (r < 1.0 - clip_low), valid, r.dtype),
            "clipfrac_high": _masked_mean((adv > 0) & (r > 1.0 + clip_high), valid, r.dtype),
            "clipfrac_dual": _masked_mean(dual, valid, r.dtype),
            "approx_kl": _masked_mean(torch.expm1(lr) - lr, valid, r.dtype),
        }
    return loss, metrics


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, *, clip_low: float, clip_high: float,
              is_weights: Optional[torch.Tensor] = None,
              cp_group: Any = None) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token per-token loss ``[B, T]`` with the sequence ratio ``s_i`` (one response per row).

    With ``cp_group`` the sequence mean of the log-ratio is summed over the CP ranks' shares of each row
    (detached, so no gradient crosses ranks: GSPO-token stops the gradient of ``s_i``).
    """
    valid = response_mask.bool()
    with torch.no_grad():
        # Selection, not `* mask`: NaN padding (logp = old_logp = -inf) must not reach the row's mean.
        stats = torch.stack([torch.where(valid, logp - old_logp, 0.0).sum(-1),
                             valid.sum(-1).to(logp.dtype)])  # [2, B]
        if cp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(stats, group=cp_group)
        seq_log_ratio = (stats[0] / stats[1].clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # log s_it = sg[log s_i] + logp_t - sg[logp_t]: value log s_i, gradient d logp_t.
    log_ratio = seq_log_ratio[:, None] + logp - logp.detach()
    loss, metrics = _clipped_surrogate(log_ratio, advantages, response_mask, clip_low=clip_low,
                                       clip_high=clip_high, dual_clip_c=None, is_weights=is_weights)
    del metrics["clipfrac_dual"]
    return loss, metrics


def fipo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, *, clip_low: float, clip_high: float,
                     dual_clip_c: float, tau: float,
                     weight_clip: tuple[float, float], safety_thresh: Optional[float] = None,
                     chunk_size: int = 128,
                     cp_group: Any = None, packed: bool = False,
                     is_weights: Optional[torch.Tensor] = None,
                     row_slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Metrics]:
    """FIPO: the DAPO loss on ``f * A`` with Future-KL weights ``f`` (:func:`fipo_weights`; ``row_slots``
    as there).

    With all weights 1 (e.g. ``weight_clip=(1, 1)``, or ``logp == old_logp`` and ``weight_clip[0] <= 1``)
    this is exactly :func:`ppo_clip_loss` with the same clip settings, i.e. GRPO/DAPO.
    """
    w, w_metrics = fipo_weights(logp, old_logp, advantages, response_mask, tau=tau, clip=weight_clip,
                                dual_clip_c=dual_clip_c, safety_thresh=safety_thresh,
                                chunk_size=chunk_size, cp_group=cp_group, packed=packed, row_slots=row_slots)
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages * w, response_mask, clip_low=clip_low,
                                  clip_high=clip_high, dual_clip_c=dual_clip_c, is_weights=is_weights)
    metrics.update({f"fipo_weight/{k}": v for k, v in w_metrics.items()})
    return loss, metrics


def _masked_mean(v: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean of ``v`` over ``valid`` in ``dtype`` (0 if nothing is valid); booleans give fractions."""
    return torch.where(valid, v.to(dtype), 0.0).sum() / valid.sum().clamp(min=1)
