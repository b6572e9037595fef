"""An algorithm that reads the attention, in one file: GRPO whose advantages are weighted per token by how
widely the final layer attended when the policy produced it.

    python pretrain_rl.py --plugin examples/plugins/attention_entropy_grpo.py algorithm.name=attention_entropy_grpo

What it reads, inside the forward pass that computes the old log-probs (no second forward): the final
layer's attention concentration ``H_t`` (the mean over heads of ``sum_i a_ti^2``, in ``[1/n_t, 1]`` over the
``n_t`` keys of query ``t``). ``-log H_t`` is the attention's collision (Renyi-2) entropy, and

    e_t = -log H_t / log n_t    in [0, 1]:  0 when one key takes all the attention, 1 when it is uniform

(0 where ``n_t < 2``). The capture below hands ``e`` over as the side channel ``attn_entropy``; it travels
with the batch like any side channel and reaches the loss as the keyword of its name (named in
``side_channels``). The loss is PPO's
clipped objective on ``(1 + beta * e_t) * A_t`` with GRPO's group advantages and aggregation, so
``beta = 0`` is GRPO exactly (tested: the same metrics as ``algorithm.name=grpo``). The metric
``attention_entropy/mean`` is ``e``'s token mean over the iteration's updates.

Nothing in ``megatron_credit`` names this algorithm: the capture and the registration below are all of it.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_credit.algorithm.capture import CaptureOutput, FinalLayerCapture
from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.algorithm.grpo import GRPO
from megatron_credit.metrics.tables import TOKEN_MEAN, MetricTable
from megatron_credit.losses import policy

NAME = "attention_entropy_grpo"


class AttentionEntropyCapture(FinalLayerCapture):
    """The final layer's normalised collision entropy per token, ``attn_entropy: [B, T]``."""

    outputs = {"attn_entropy": CaptureOutput(torch.float32)}

    def read(self, result):
        h, n = result["H"].float(), result["n"].float()
        e = -torch.log(h.clamp(min=1e-30)) / torch.log(n.clamp(min=2.0))
        return {"attn_entropy": torch.where(n >= 2, e.clamp(0.0, 1.0), 0.0)}


class AttentionEntropyGRPO(GRPO):
    """GRPO (its group advantages and aggregation) with PPO's clipped loss on ``(1 + beta e_t) A_t``."""

    side_channels = ("attn_entropy",)
    metrics = (MetricTable(means={"attention_entropy/mean": ("sum:attn_entropy_mean", "sum:tokens")},
                           reduce={"attn_entropy_mean": TOKEN_MEAN}),)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config(GRPO.Config):
        """``algorithm.params`` of ``attention_entropy_grpo``: GRPO's (``clip_eps``, ``norm_by_std``) and ``beta``."""

        beta: float = 1.0
        """Extra weight of a token produced with uniform final-layer attention: ``w = 1 + beta * e``."""

        def __post_init__(self) -> None:
            if not self.beta >= 0:
                raise ValueError(f"algorithm.params.beta must be >= 0, got {self.beta!r}")

    def capture(self, *, top_k: int = 0) -> AttentionEntropyCapture:
        return AttentionEntropyCapture()

    def loss(self, logp, old_logp, advantages, response_mask, *, attn_entropy, cp_group=None, is_weights=None,
             row_slots=None):
        """PPO's clipped loss on ``(1 + beta * attn_entropy) * advantages``; reports this micro-batch's mean
        entropy."""
        m = response_mask.bool()
        eps, beta = self.config.clip_eps, self.config.beta
        loss, metrics = policy.ppo_clip_loss(logp, old_logp, advantages * (1.0 + beta * attn_entropy), response_mask,
                                             clip_low=eps, clip_high=eps, dual_clip_c=None, is_weights=is_weights)
        metrics["attn_entropy_mean"] = torch.where(m, attn_entropy, 0.0).sum() / m.sum().clamp(min=1)
        return loss, metrics


if NAME not in ALGORITHMS:  # importing the file twice (torchrun ranks share nothing; tests may) is harmless
    ALGORITHMS.add(NAME, AttentionEntropyGRPO.Config)
