"""FIPO: Future-KL influenced token weights.

Follows the published FIPO code (whose numbers the paper's tables match), docs/architecture.md "FIPO":

    d_k   = clamp(logp_k - old_logp_k, -20, 20)
    M_k   = [d_k <= log c]                          (c = dual-clip constant)
    F_t   = sum_{k >= t} M_k m_k gamma**(k - t) d_k,  gamma = 2**(-1/tau)
    f_t   = clamp(exp(F_t), lo, hi);  f_t = min(f_t, 1) where A_t < 0 and ratio_t > s;  detached

with ``s = safety_thresh`` (default: ``c``).

Departures from the published code:

- ``F`` is computed by :func:`~megatron_credit.credit.scan.reverse_linear_scan` in O(B*T*K) time
  instead of O(B*T**2) decay-matrix blocks; the sum is the same (to float rounding).
- What a row holds. ``packed=False`` (default, the published semantics): each row holds one response; the
  decay runs over positions, so masked tokens inside the row contribute 0 evidence but do not cut the
  transport. ``packed=True``: each maximal run of ``response_mask == 1`` is its own response (packed rows
  where responses are separated by prompt or padding tokens); the transport is cut at every masked
  token. The two agree on rows with one contiguous response.
- Multi-turn trajectories (``obs_mask``, docs/multi_turn.md): the future of a token runs through every
  later turn of its trajectory, and the discount counts the policy's tokens only: an observation between
  turns passes the sum on unchanged (``coef = 1``, no evidence), so ``gamma**(k - t)`` has ``k - t`` = the
  action tokens between them, whatever the tool printed.
- Results at masked positions are 0. The published code's option of dropping responses with more than
  one dual-clipped token lives with the loss (:func:`multi_dual_clip_keep`), not here.
- Masked positions may hold anything, including NaN or -inf (e.g. padding with ``logp = old_logp =
  -inf``): log-ratios are made finite before any product with the mask (``NaN * 0 = NaN`` would
  otherwise reach every valid token of the row through the scan), and results are selected with
  ``where``.
- Weight cap. The published code caps ``f`` at 1 for ``A < 0`` tokens whose ratio exceeds a separate
  ``safety_thresh`` (default 4.0; 10.0 in its 32B config), not necessarily the dual-clip ``c`` that
  defines ``M``. :func:`fipo_weights` takes ``safety_thresh`` (``None``: use ``dual_clip_c``).
- Lower clamp. ``clip[0]`` bounds ``f`` from below; at the default ``clip = (1.0, 1.2)`` a negative
  future KL never down-weights a token (``f`` lies in ``[1, 1.2]``, capped tokens at exactly 1). A
  ``clip[0] < 1`` lets drifting-down futures shrink the update.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_credit.credit.scan import reverse_linear_scan

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (the published FIPO code; beyond it ``exp``
means nothing to any estimator and overflows float16 / bfloat16). The one definition: the policy losses,
the KL estimators and the rollout mismatch read it from here."""
FIPO_TAU = 32.0
"""FIPO's default half-life of the future discount (``gamma = 2^(-1/tau)``, docs/architecture.md "FIPO")."""
FIPO_DUAL_CLIP_C = 10.0
"""FIPO's default dual-clip constant ``c`` (also the threshold of ``M_k``): 10 for 32B, 3 for 7B."""
FIPO_WEIGHT_CLIP = (1.0, 1.2)
"""FIPO's default ``[lo, hi]`` clip of ``exp(F_t)`` (32B; the 7B recipe uses [0.8, 1.2])."""


def future_kl(logp: torch.Tensor, old_logp: torch.Tensor, response_mask: torch.Tensor, *, tau: float,
              dual_clip_c: float, chunk_size: int = 128, cp_group: Any = None,
              packed: bool = False, row_slots: torch.Tensor | None = None,
              obs_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Discounted future sum of log-probability shifts, ``F: [B, T]`` (0 at masked tokens).

    Args:
        logp: current policy log-probs of the sampled tokens ``[B, T]``.
        old_logp: behaviour (old) policy log-probs ``[B, T]``.
        response_mask: ``[B, T]`` bool or 0/1; 1 on response tokens.
        tau: half-life in tokens (``gamma = 2**(-1/tau)``).
        dual_clip_c: tokens with ``ratio > c`` are left out of the future sums (``M_k``); ``c > 1``.
        chunk_size, cp_group: see :func:`reverse_linear_scan` (CP chunk order: megatron's load-balanced one).
        packed: treat each run of the mask as its own response (see module docstring).
        row_slots: ``[B, T]`` bool, False at empty slots inside a row (a packed micro-batch's row view under
            CP: each half of the row ends with empty slots, ``batch/packing.py``); the transport passes
            them unchanged (``coef = 1``, no evidence). None: every slot holds a token.
        obs_mask: ``[B, T]`` bool, True on the environment's tokens of a multi-turn trajectory: passed like
            empty slots (module docstring). None: single-turn.
    """
    row_slots = pass_observations(row_slots, obs_mask)
    _check_c(dual_clip_c)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    with torch.no_grad():  # F is only ever used detached; in-place ops keep memory at ~2 [B, T] buffers
        # 0/1 as uint8 (a view of a bool mask): multiplying by it is as fast as by a float mask and
        # saves a [B, T] float buffer; fewer live buffers also keep glibc from trimming and re-faulting
        # the heap on every call at long T (2-3x of the whole kernel at T = 20480 on CPU).
        m = response_mask.view(torch.uint8) if response_mask.dtype == torch.bool else response_mask != 0
        # Padding may hold NaN / -inf (logp = old_logp = -inf gives NaN), and NaN * 0 = NaN would reach
        # every valid token through the scan. So every value is made finite first (NaN -> 0, +-inf ->
        # +-20 by the clamp); after that the 0/1 products below are exact selections. This is ~2x
        # cheaper on CPU than torch.where on a bool mask. A NaN at a *valid* token also becomes 0 here,
        # but stays visible in the loss, whose ratio at that token is NaN.
        d = (logp - old_logp).nan_to_num_(0.0).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # x_k = M_k m_k d_k: tokens with ratio > c, and masked tokens, bring no evidence. The comparison
        # writes 0/1 floats directly (bool intermediates are ~5x slower on CPU).
        keep = torch.le(d, math.log(dual_clip_c), out=torch.empty_like(d))
        x = d.mul_(keep.mul_(m))
        del keep  # its memory is reused by the scan's output
        gamma = 2.0 ** (-1.0 / tau)
        # coef_t = gamma * m_t cuts after every masked token: y at a masked t is x_t = 0, so the token
        # before it receives nothing from beyond. No halo from the next CP chunk is needed.
        coef = m.to(logp.dtype).mul_(gamma) if packed else gamma
        if row_slots is not None:  # empty slots pass the carry on unchanged (x is 0 there: m is 0)
            if not isinstance(coef, torch.Tensor):
                coef = torch.full_like(x, coef)
            coef = torch.where(row_slots, coef, 1.0)
        y = reverse_linear_scan(x, coef, chunk_size=chunk_size, cp_group=cp_group)
        return y.mul_(m)  # y is finite everywhere (finite x, coef), so this product is exact


def pass_observations(row_slots: torch.Tensor | None, obs_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``row_slots`` with the observations of a multi-turn trajectory marked as slots the scan passes
    unchanged (False), or ``row_slots`` as it is without observations."""
    if obs_mask is None:
        return row_slots
    keep = ~obs_mask.bool()
    return keep if row_slots is None else row_slots & keep


def fipo_weights(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, *, tau: float = FIPO_TAU,
                 clip: tuple[float, float] = FIPO_WEIGHT_CLIP, dual_clip_c: float = FIPO_DUAL_CLIP_C, safety_thresh: float | None = None, chunk_size: int = 128,
                 cp_group: Any = None, packed: bool = False,
                 row_slots: torch.Tensor | None = None,
                 obs_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FIPO token weights ``f: [B, T]`` (detached; 1 at masked tokens) and detached metrics.

    ``f = clamp(exp(F), clip[0], clip[1])`` (``clip[0]`` is the lower clamp: at the default 1.0 a
    negative future KL never shrinks a token's update), then ``f = min(f, 1)`` where ``A < 0`` and the
    ratio exceeds ``safety_thresh``. ``safety_thresh=None`` uses ``dual_clip_c``; the published code has a
    separate threshold (default 4.0, 10.0 in its 32B config), pass it to reproduce that.

    ``advantages: [B, T]``. The DAPO loss then uses ``f * advantages``. Metrics are over this rank's
    valid tokens: ``mean/min/max``, ``dev_sq`` (the mean of ``(f - 1)**2`` in float64: with
    ``mean`` it gives the weights' standard deviation summed over micro-batches and ranks, without the
    cancellation of ``E[f**2] - E[f]**2`` at ``f ~ 1``), ``frac_at_low``, ``frac_at_high`` (at each clip bound),
    ``frac_dual_masked`` (tokens excluded from the future sums by ``M``), ``frac_dual_capped`` (``A < 0``
    and ratio > safety_thresh, capped at 1). Statistics of an empty selection are NaN.
    """
    lo, hi = clip
    if not 0 < lo <= hi:
        raise ValueError(f"clip must satisfy 0 < clip[0] <= clip[1], got {clip}")
    if safety_thresh is None:
        safety_thresh = dual_clip_c
    if not safety_thresh > 0:
        raise ValueError(f"safety_thresh must be > 0, got {safety_thresh}")
    with torch.no_grad():
        f = future_kl(logp, old_logp, response_mask, tau=tau, dual_clip_c=dual_clip_c,
                      chunk_size=chunk_size, cp_group=cp_group, packed=packed, row_slots=row_slots,
                      obs_mask=obs_mask)
        w = torch.exp(f).clamp(lo, hi)
        d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        over_c = d > math.log(dual_clip_c)  # ratio > c, compared in log space (no overflow)
        capped = (advantages < 0) & (d > math.log(safety_thresh))
        w = torch.where(capped, w.clamp(max=1.0), w)
        valid = response_mask.bool()
        w = torch.where(valid, w, torch.ones_like(w))
        metrics = masked_summary(w, valid, quantiles=())  # what the trainer reduces (metrics/tables.FIPO)
        n = valid.sum().clamp(min=1).to(w.dtype)
        metrics.update(
            dev_sq=torch.where(valid, (w.double() - 1) ** 2, 0.0).sum() / n,
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
        "mean": torch.where(ok, flat, 0.0).sum() / n.clamp(min=1),  # where: NaN * 0 would be NaN
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


def multi_dual_clip_keep(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                         response_mask: torch.Tensor, *, dual_clip_c: float, max_dual_clipped: int = 1,
                         cp_group: Any = None) -> torch.Tensor:
    """Rows to keep in the loss, ``[B]`` bool: at most ``max_dual_clipped`` dual-clipped tokens.

    A token is dual-clipped when the dual clip is active on it: ``A < 0`` and ratio > c (as in the
    published FIPO code; a ratio > c with ``A >= 0`` is handled by the ordinary clip). The published code
    drops responses with more than one such token (an option, off by default in this project, on in the
    recipe that reproduces the paper). One response per row; with ``cp_group`` the rows are CP shards
    and the ``[B]`` counts are summed over the group, so every rank decides on the whole response.

    >>> lp = torch.zeros(2, 3); old = torch.tensor([[-3.0, -3.0, 0.0], [-3.0, -3.0, 0.0]])
    >>> adv = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 1.0, -1.0]])
    >>> multi_dual_clip_keep(lp, old, adv, torch.ones(2, 3), dual_clip_c=10.0)
    tensor([False,  True])
    """
    _check_c(dual_clip_c)
    with torch.no_grad():
        d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        # Comparisons with NaN are False, so NaN padding is not counted.
        clipped = (advantages < 0) & (d > math.log(dual_clip_c)) & response_mask.bool()
        counts = clipped.sum(dim=-1)
        if cp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=cp_group)
        return counts <= max_dual_clipped


def _check_c(c: float) -> None:
    if not c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {c}")
