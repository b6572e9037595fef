"""The group-relative algorithms: GRPO, Dr.GRPO, RLOO, DAPO and GSPO (docs/architecture.md "Baselines").

Each scores a response against the other responses to its prompt (``credit.group``), broadcasts that one
advantage to every token, and has no critic. They differ in the estimator (divided by the group's std or
not, leave-one-out), the clip of the ratio (symmetric, clip-higher with a dual clip, the sequence ratio)
and how the per-token loss is reduced.

>>> DAPO.Config()
DAPO.Config(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

from megatron_credit.algorithm.base import AdvantageInputs, AdvantageOutput, Algorithm, ClipFraction, PPOClip
from megatron_credit.credit import group
from megatron_credit.losses import policy
from megatron_credit.typed_build import NonNegativeFloat, Range

DualClip = Annotated[float, Range(gt=1)]
"""The dual-clip constant ``c`` (``-A c`` caps the loss of a negative advantage): above 1."""


def _per_token(advantages, inputs: AdvantageInputs) -> AdvantageOutput:
    return AdvantageOutput(advantages=group.broadcast_to_tokens(advantages, inputs.response_mask))


class GRPO(PPOClip):
    """GRPO: the group-normalised score, PPO's symmetric clip, the mean over each response's tokens."""

    loss_agg_mode = "seq-mean-token-mean"

    @dataclass(frozen=True, kw_only=True)
    class Config(PPOClip.Config):
        """GRPO."""

        norm_by_std: bool = True
        """Divide the group-centred score by the group's standard deviation."""

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("scores", "group_ids")
        return _per_token(group.grpo_advantages(inputs.scores, inputs.group_ids,
                                                norm_by_std=self.config.norm_by_std), inputs)


class DrGRPO(GRPO):
    """Dr.GRPO: score minus the group mean (never divided by the std), summed over tokens and divided by
    a fixed length (the trainer hands over ``norm_length``, ``rollout.max_response_len``)."""

    loss_agg_mode = "seq-mean-token-sum-norm"

    @dataclass(frozen=True, kw_only=True)
    class Config(PPOClip.Config):
        """Dr.GRPO: symmetric PPO clip. No ``norm_by_std``: the estimator never divides by the group's
        standard deviation, so a recipe that sets it is refused (unknown field)."""

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("scores", "group_ids")
        return _per_token(group.dr_grpo_advantages(inputs.scores, inputs.group_ids), inputs)


class RLOO(GRPO):
    """RLOO: score minus the leave-one-out group mean, the mean over all tokens."""

    loss_agg_mode = "token-mean"

    @dataclass(frozen=True, kw_only=True)
    class Config(PPOClip.Config):
        """RLOO: symmetric PPO clip (no ``norm_by_std``, as Dr.GRPO)."""

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("scores", "group_ids")
        return _per_token(group.rloo_advantages(inputs.scores, inputs.group_ids), inputs)


class DAPO(Algorithm):
    """DAPO: GRPO's advantages, clip-higher and a dual clip for negative advantages, the mean over all
    tokens."""

    loss_agg_mode = "token-mean"

    @dataclass(frozen=True, kw_only=True)
    class Config(Algorithm.Config):
        """DAPO: clip-higher and dual clip."""

        clip_low: ClipFraction = 0.2
        """eps_low."""
        clip_high: NonNegativeFloat = 0.28
        """eps_high (clip-higher)."""
        dual_clip_c: Optional[DualClip] = 3.0
        """Dual-clip constant for A < 0 (None: off)."""

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("scores", "group_ids")
        return _per_token(group.grpo_advantages(inputs.scores, inputs.group_ids), inputs)

    def loss(self, logp, old_logp, advantages, response_mask, *, cp_group=None, is_weights=None, row_slots=None):
        c = self.config
        return policy.ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low=c.clip_low,
                                    clip_high=c.clip_high, dual_clip_c=c.dual_clip_c, is_weights=is_weights)


class GSPO(DAPO):
    """GSPO: GRPO's advantages, the clip on the sequence ratio (``losses.policy.gspo_loss``), the mean
    over each response's tokens."""

    loss_agg_mode = "seq-mean-token-mean"

    @dataclass(frozen=True, kw_only=True)
    class Config(Algorithm.Config):
        """GSPO: sequence-ratio clip (its ranges are ~1e-4)."""

        clip_low: ClipFraction = 3e-4
        """eps_low of the sequence ratio."""
        clip_high: NonNegativeFloat = 4e-4
        """eps_high of the sequence ratio."""

    def loss(self, logp, old_logp, advantages, response_mask, *, cp_group=None, is_weights=None, row_slots=None):
        c = self.config
        return policy.gspo_loss(logp, old_logp, advantages, response_mask, clip_low=c.clip_low,
                                clip_high=c.clip_high, is_weights=is_weights, cp_group=cp_group)
