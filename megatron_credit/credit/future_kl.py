"""FIPO: Future-KL influenced token weights.

Follows the published FIPO code (whose numbers the paper's tables match), DESIGN.md "FIPO":

    d_k   = clamp(logp_k - old_logp_k, -20, 20)
    M_k   = [d_k <= log c]                          (c = dual-clip constant)
    F_t   = sum_{k >= t} M_k m_k gamma**(k - t) d_k,  gamma = 2**(-1/tau)
    f_t   = clamp(exp(F_t), lo, hi);  f_t = min(f_t, 1) where A_t < 0 and ratio_t > c;  detached

Departures from the published code:

- ``F`` is computed by :func:`~megatron_credit.credit.scan.reverse_linear_scan` in O(B*T*K) time
  instead of O(B*T**2) decay-matrix blocks; the sum is the same (to float rounding).
- Row layout. ``packed=False`` (default, the published semantics): each row holds one response; the
  decay runs over positions, so masked tokens inside the row contribute 0 evidence but do not cut the
  transport. ``packed=True``: each maximal run of ``response_mask == 1`` is its own response (packed rows
  where responses are separated by prompt or padding tokens); the transport is cut at every masked
  token. The two agree on rows with one contiguous response.
- Results at masked positions are 0. The published code's option of dropping responses with more than
  one dual-clipped token lives with the loss (:func:`multi_dual_clip_keep`), not here.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_credit.credit.scan import reverse_linear_scan

LOG_RATIO_CLAMP = 20.0  # published code clamps log-ratios to [-20, 20] before exp


def future_kl(logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor, *, tau: float,
              dual_clip_c: float, chunk_size: int = 128, cp_group: Any = None,
              packed: bool = False) -> torch.Tensor:
    """Discounted future sum of log-probability shifts, ``F: [B, T]`` (0 at masked tokens).

    Args:
        logp: current policy log-probs of the sampled tokens ``[B, T]``.
        old_logp: behaviour (old) policy log-probs ``[B, T]``.
        response_mask: ``[B, T]`` bool or 0/1; 1 on response tokens.
        tau: half-life in tokens (``gamma = 2**(-1/tau)``).
        dual_clip_c: tokens with ``ratio > c`` are left out of the future sums (``M_k``); ``c > 1``.
        chunk_size, cp_group: see :func:`reverse_linear_scan` (CP layout: megatron load-balanced).
        packed: treat each run of the mask as its own response (see module docstring).
    """
    _check_c(dual_clip_c)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    with torch.no_grad():  # F is only ever used detached; in-place ops keep memory at ~2 [B, T] buffers
        m = float_mask(response_mask, logp.dtype)
        d = (logp - old_logp).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # x_k = M_k m_k d_k: tokens with ratio > c, and masked tokens, bring no evidence. The comparison
        # writes 0/1 floats directly (bool intermediates are ~5x slower on CPU).
        keep = torch.le(d, math.log(dual_clip_c), out=torch.empty_like(d))
        x = d.mul_(keep.mul_(m))
        gamma = 2.0 ** (-1.0 / tau)
        # coef_t = gamma * m_t cuts after every masked token: y at a masked t is x_t = 0, so the token
        # before it receives nothing from beyond. No halo from the next CP chunk is needed.
        coef = m.mul(gamma) if packed else gamma
        y = reverse_linear_scan(x, coef, chunk_size=chunk_size, cp_group=cp_group)
        return y.mul_(m)


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` (bool or numeric, ``[B, T]``) as 0/1 in ``dtype``; bool goes through a uint8 view, which
    converts several times faster than bool on CPU."""
    return (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).to(dtype)


def fipo_weights(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, *, tau: float = 32.0, clip: tuple[float, float] = (1.0, 1.2),
                 dual_clip_c: float = 10.0, chunk_size: int = 128, cp_group: Any = None,
                 packed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FIPO token weights ``f: [B, T]`` (detached; 1 at masked tokens) and detached metrics.

    ``advantages: [B, T]``. The DAPO loss then uses ``f * advantages``. Metrics are over this rank's
    valid tokens: ``mean/min/max/p10/p50/p90``, ``frac_at_low``, ``frac_at_high`` (at each clip bound),
    ``frac_dual_masked`` (tokens excluded from the future sums by ``M``), ``frac_dual_capped`` (``A < 0``
    and ratio > c, capped at 1). Statistics of an empty selection are NaN.
    """
    lo, hi = clip
    if not 0 < lo <= hi:
        raise ValueError(f"clip must satisfy 0 < clip[0] <= clip[1], got {clip}")
    with torch.no_grad():
        f = future_kl(logp, old_logp, response_mask, tau=tau, dual_clip_c=dual_clip_c,
                      chunk_size=chunk_size, cp_group=cp_group, packed=packed)
        w = torch.exp(f).clamp(lo, hi)
        d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        over_c = d > math.log(dual_clip_c)  # ratio > c, compared in log space (no overflow)
        capped = (advantages < 0) & over_c
        w = torch.where(capped, w.clamp(max=1.0), w)
        valid = response_mask.bool()
        w = torch.where(valid, w, torch.ones_like(w))
        metrics = masked_summary(w, valid)
        n = valid.sum().clamp(min=1).to(w.dtype)
        metrics.update(
            frac_at_low=((w <= lo) & valid).sum() / n,
            frac_at_high=((w >= hi) & valid).sum() / n,
            frac_dual_masked=(over_c & valid).sum() / n,
            frac_dual_capped=(capped & valid).sum() / n,
        )
    return w, metrics


def masked_summary(v: torch.Tensor, valid: torch.Tensor, *,
                   quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)) -> dict[str, torch.Tensor]:
    """Mean, min, max and linear-interpolated quantiles of ``v[valid]`` without a host sync.

    >>> v = torch.tensor([[1.0, 5.0, 2.0, 9.0]]); ok = torch.tensor([[True, True, True, False]])
    >>> {k: round(float(x), 3) for k, x in masked_summary(v, ok, quantiles=(0.5,)).items()}
    {'mean': 2.667, 'min': 1.0, 'max': 5.0, 'p50': 2.0}
    """
    flat, ok = v.detach().reshape(-1), valid.reshape(-1)
    nan = torch.full((), float("nan"), dtype=v.dtype, device=v.device)
    names = ["mean", "min", "max"] + [f"p{round(q * 100)}" for q in quantiles]
    if flat.numel() == 0:
        return {k: nan.clone() for k in names}
    n = ok.sum()
    empty = n == 0
    inf = torch.full_like(flat, math.inf)
    out = {
        "mean": (flat * ok).sum() / n.clamp(min=1),
        "min": torch.where(ok, flat, inf).min(),
        "max": torch.where(ok, flat, -inf).max(),
    }
    # Valid values sort first (invalid ones become +inf); index the sorted prefix like torch.quantile.
    srt = torch.sort(torch.where(ok, flat, inf)).values
    last = (n - 1).clamp(min=0)
    for q, name in zip(quantiles, names[3:]):
        pos = q * last.to(v.dtype)
        i0 = pos.floor().long()
        i1 = torch.minimum(i0 + 1, last)
        out[name] = srt[i0] + (pos - i0.to(v.dtype)) * (srt[i1] - srt[i0])
    return {k: torch.where(empty, nan, x) for k, x in out.items()}


def multi_dual_clip_keep(logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor, *,
                         dual_clip_c: float, max_dual_clipped: int = 1) -> torch.Tensor:
    """Rows to keep in the loss, ``[B]`` bool: at most ``max_dual_clipped`` tokens with ratio > c.

    The published FIPO code drops responses with more than one dual-clipped token (an option, off by
    default in this project, on in the recipe that reproduces the paper). One response per row.
    """
    _check_c(dual_clip_c)
    d = (logp - old_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    over = (d > math.log(dual_clip_c)) & response_mask.bool()
    return over.sum(dim=-1) <= max_dual_clipped


def _check_c(c: float) -> None:
    if not c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {c}")
