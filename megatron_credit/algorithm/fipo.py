"""FIPO (docs/architecture.md "FIPO"): the DAPO objective on ``f_t * A_t``, with the Future-KL weights ``f_t`` of
``credit.future_kl`` (``gamma = 2^(-1/tau)``, tokens past the dual-clip constant ``c`` masked out of the
future sum).

>>> FIPO.Config().tau, FIPO.Config().dual_clip_c
(32.0, 10.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_credit.algorithm.grpo import DAPO, DualClip
from megatron_credit.metrics.tables import FIPO as FIPO_METRICS
from megatron_credit.credit.future_kl import (FIPO_DUAL_CLIP_C, FIPO_TAU, FIPO_WEIGHT_CLIP, fipo_weights, future_kl,
                                              multi_dual_clip_keep)
from megatron_credit.losses import policy
from megatron_credit.typed_build import PositiveFloat


class FIPO(DAPO):
    """FIPO = DAPO on ``f * A`` (GRPO's advantages, token-mean)."""

    metrics = (FIPO_METRICS,)

    @dataclass(frozen=True, kw_only=True)
    class Config(DAPO.Config):
        """FIPO = DAPO on ``f_t * A_t`` with Future-KL weights (docs/architecture.md "FIPO")."""

        dual_clip_c: DualClip = FIPO_DUAL_CLIP_C
        """Dual-clip constant ``c``; also the participation threshold of ``M_k`` (10 for 32B, 3 for 7B)."""
        tau: PositiveFloat = FIPO_TAU
        """Half-life of the future discount: ``gamma = 2^(-1/tau)``."""
        weight_clip: tuple[PositiveFloat, PositiveFloat] = FIPO_WEIGHT_CLIP
        """``[lo, hi]`` clip of ``exp(F_t)``."""
        safety_thresh: Optional[PositiveFloat] = None
        """Ratio above which ``f = min(f, 1)`` for A < 0 (None: ``dual_clip_c``)."""
        drop_multi_dual_clip: bool = False
        """Drop responses with more than one dual-clipped token (the published code; off by default)."""

        def __post_init__(self) -> None:
            if getattr(super(), "__post_init__", None):
                super().__post_init__()
            w = tuple(float(x) for x in self.weight_clip)
            if len(w) != 2 or not w[0] <= w[1]:
                raise ValueError(f"algorithm.params.weight_clip must be [lo, hi] with lo <= hi, got {self.weight_clip!r}")
            object.__setattr__(self, "weight_clip", w)

    def loss(self, logp, old_logp, advantages, response_mask, *, cp_group=None, is_weights=None, row_slots=None):
        """:func:`~megatron_credit.losses.policy.fipo_policy_loss` (the weights computed on this rank's CP
        shard with the carry exchange over ``cp_group``), optionally dropping whole responses with more than
        one dual-clipped token (the published code's rule; counts summed over CP)."""
        c = self.config
        if c.drop_multi_dual_clip:
            keep = multi_dual_clip_keep(logp, old_logp, advantages, response_mask, dual_clip_c=c.dual_clip_c,
                                        cp_group=cp_group)
            response_mask = response_mask.bool() & keep[:, None]
        return policy.fipo_policy_loss(logp, old_logp, advantages, response_mask, clip_low=c.clip_low,
                                       clip_high=c.clip_high, dual_clip_c=c.dual_clip_c, tau=c.tau,
                                       weight_clip=c.weight_clip, safety_thresh=c.safety_thresh,
                                       cp_group=cp_group, is_weights=is_weights, row_slots=row_slots)

    def credit_fields(self, *, logp, old_logp, advantages, mask, side):
        """The credit the loss applies, ``advantage = f_t * A_t`` (0 for a response the loss drops), the
        weights ``f_t`` and the Future-KL ``F_t`` they come from (``credit.future_kl``), as the loss computed
        them from the same log-probs."""
        c = self.config
        obs = side.get("obs_mask")  # a multi-turn batch's observations: the scan passes across them
        f, _ = fipo_weights(logp, old_logp, advantages, mask, tau=c.tau, clip=c.weight_clip,
                            dual_clip_c=c.dual_clip_c, safety_thresh=c.safety_thresh, obs_mask=obs)
        applied = advantages * f
        if c.drop_multi_dual_clip:
            keep = multi_dual_clip_keep(logp, old_logp, advantages, mask, dual_clip_c=c.dual_clip_c)
            applied = applied * keep[:, None]
        return {"advantage": applied, "f_t": f,
                "future_kl": future_kl(logp, old_logp, mask, tau=c.tau, dual_clip_c=c.dual_clip_c, obs_mask=obs)}
