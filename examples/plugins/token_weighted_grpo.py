"""An algorithm in one file: GRPO whose advantages are weighted per token by the behaviour policy's doubt.

    python pretrain_rl.py --plugin examples/plugins/token_weighted_grpo.py algorithm.name=token_weighted_grpo

``w_t = 1 + beta * (1 - pi_old(y_t))``: tokens the policy sampled with low probability (the "forks" of a
response) get up to ``1 + beta`` times the group advantage; near-certain tokens keep it. The weight is a
side channel: computed once from the behaviour pass's log-probs (``behaviour_extras``), it travels with
the batch's micro-batches (cut, CP-split, on the actor's device) and reaches the policy loss as the
keyword ``token_weight`` (named in ``side_channels``). The loss is PPO's clipped objective on ``w_t * A_t`` with GRPO's aggregation,
so ``beta = 0`` is GRPO exactly (tested: the same metrics as ``algorithm.name=grpo``); the metric
``token_weighted/weight_mean`` is the weights' token mean over the iteration's updates.

Nothing in ``megatron_credit`` names this algorithm: the class and the registration below are all of it.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.algorithm.grpo import GRPO
from megatron_credit.metrics.tables import TOKEN_MEAN, MetricTable
from megatron_credit.losses import policy

NAME = "token_weighted_grpo"


class TokenWeightedGRPO(GRPO):
    """GRPO (its group advantages and aggregation) with PPO's clipped loss on ``token_weight * A``."""

    side_channels = ("token_weight",)
    metrics = (MetricTable(means={"token_weighted/weight_mean": ("sum:token_weight_mean", "sum:tokens")},
                           reduce={"token_weight_mean": TOKEN_MEAN}),)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config(GRPO.Config):
        """``algorithm.params`` of ``token_weighted_grpo``: GRPO's (``clip_eps``, ``norm_by_std``) and ``beta``."""

        beta: float = 1.0
        """Extra weight of a token sampled with probability 0: ``w = 1 + beta * (1 - p)``."""

        def __post_init__(self) -> None:
            if not self.beta >= 0:
                raise ValueError(f"algorithm.params.beta must be >= 0, got {self.beta!r}")

    def behaviour_extras(self, batch) -> dict[str, torch.Tensor]:
        """The side channel, ``[B, T]``: ``1 + beta * (1 - exp(old_logp))`` on response tokens, 0 elsewhere."""
        p = batch.old_logp.exp()
        return {"token_weight": torch.where(batch.loss_mask, 1.0 + self.config.beta * (1.0 - p), 0.0)}

    def loss(self, logp, old_logp, advantages, response_mask, *, token_weight, cp_group=None, is_weights=None,
             row_slots=None):
        """PPO's clipped loss on ``token_weight * advantages``; reports this micro-batch's mean weight."""
        m = response_mask.bool()
        eps = self.config.clip_eps
        loss, metrics = policy.ppo_clip_loss(logp, old_logp, advantages * token_weight, response_mask,
                                             clip_low=eps, clip_high=eps, dual_clip_c=None, is_weights=is_weights)
        metrics["token_weight_mean"] = torch.where(m, token_weight, 0.0).sum() / m.sum().clamp(min=1)
        return loss, metrics


if NAME not in ALGORITHMS:  # importing the file twice (torchrun ranks share nothing; tests may) is harmless
    ALGORITHMS.add(NAME, TokenWeightedGRPO.Config)
