"""PPO with GAE (docs/architecture.md "Baselines"): a critic's values, generalised advantage estimation, whitened
advantages and PPO's symmetric clip.

>>> PPO.Config().critic, PPO.Config().build().critic_kind.separate_model
('trunk', False)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_credit.algorithm.base import ActorCritic, AdvantageInputs, AdvantageOutput, AdvantagePost, PPOClip
from megatron_credit.metrics.tables import CRITIC
from megatron_credit.credit.gae import gae
from megatron_credit.typed_build import PositiveFloat, UnitFloat


class PPO(PPOClip, ActorCritic):
    """PPO: GAE over per-token rewards and the critic's values, symmetric clip, token-mean."""

    metrics = (CRITIC,)
    critics = ("trunk", "separate")

    @dataclass(frozen=True, kw_only=True)
    class Config(PPOClip.Config, ActorCritic.Config):
        """PPO with GAE and a value head on the actor trunk."""

        gamma: UnitFloat = 1.0
        """GAE discount."""
        lam: UnitFloat = 0.95
        """GAE lambda."""
        whiten_advantages: bool = True
        """Whiten advantages over the global batch (masked, across DP), as peers do."""
        value_clip: Optional[PositiveFloat] = 0.2
        """Clip of the new value around the old one in the value loss (None: unclipped)."""
        critic: str = "trunk"
        """``trunk``: a value head on the actor's final hidden state, trained with the policy (one model, one
        optimizer, one clip). ``separate``: a value model of its own, as verl / OpenRLHF build it: a GPTModel
        of the actor's architecture and layout, initialised from the actor's starting weights (after a
        warm-up), with a zero-initialised value head, its own DDP, optimizer (``optim.critic_lr`` for all of
        it), gradient clip and checkpoint; the policy's gradients then carry no value loss."""

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("token_rewards", "values")
        adv, ret = gae(inputs.token_rewards, inputs.values, inputs.response_mask, obs_mask=inputs.obs_mask,
                       gamma=self.config.gamma,
                       lam=self.config.lam, cp_group=cp_group)
        return AdvantageOutput(advantages=adv, returns=ret)

    @property
    def advantage_post(self) -> AdvantagePost:
        return AdvantagePost(whiten=self.config.whiten_advantages)
