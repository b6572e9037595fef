"""An algorithm is one registration: a new algorithm with a side channel, a per-token weight
computed from the behaviour pass, is registered from this file alone and trained for 2 iterations through
the real trainer (``trainer.loop.train``, one gloo rank). Nothing in ``megatron_credit`` names it.

The algorithm: GRPO's advantages, PPO's clipped loss on ``w_t * A_t`` with ``w_t = max(pi_old(y_t), floor)``
(the behaviour policy's probability of the sampled token, from the behaviour pass's ``old_logp``), and a
metric of its own (``weighted/token_weight_mean``).
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.algorithm.grpo import GRPO
from megatron_credit.metrics.tables import TOKEN_MEAN, MetricTable
from megatron_credit.losses import policy
from tests.support.distributed_harness import DistributedPool

NAME = "test_prob_weighted_grpo"

SEEN: list = []
"""What the algorithm saw in this process: ``("pass", weights, old_logp, mask)`` per behaviour pass and
``("loss", weight sum, token count, max |w - expected|)`` per micro-batch loss."""


class ProbWeightedGRPO(GRPO):
    """GRPO's advantages and aggregation, PPO's clipped loss on ``token_weight * A``."""

    loss_agg_mode = "token-mean"
    side_channels = ("token_weight",)
    metrics = (MetricTable(means={"weighted/token_weight_mean": ("sum:token_weight_mean", "sum:tokens")},
                           reduce={"token_weight_mean": TOKEN_MEAN}),)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Config(GRPO.Config):
        """The new algorithm's ``algorithm.params``."""

        floor: float = 0.25
        """Smallest token weight."""

    def behaviour_extras(self, batch):
        """The side channel: ``[B, T]`` weights from the behaviour pass's log-probs (0 off the response)."""
        w = torch.where(batch.loss_mask, batch.old_logp.exp().clamp(min=self.config.floor), 0.0)
        SEEN.append(("pass", w.clone(), batch.old_logp.clone(), batch.loss_mask.clone()))
        return {"token_weight": w}

    def loss(self, logp, old_logp, advantages, response_mask, *, token_weight, cp_group=None, is_weights=None,
             row_slots=None):
        """PPO's clipped loss on ``token_weight * A``; reports the weights' mean over this micro-batch."""
        m = response_mask.bool()
        expected = torch.where(m, old_logp.detach().exp().clamp(min=0.25), 0.0)  # the same tokens, recomputed
        SEEN.append(("loss", float(token_weight[m].sum()), int(m.sum()), float((token_weight - expected).abs().max())))
        eps = self.config.clip_eps
        loss, metrics = policy.ppo_clip_loss(logp, old_logp, advantages * token_weight, response_mask,
                                             clip_low=eps, clip_high=eps, dual_clip_c=None, is_weights=is_weights)
        metrics["token_weight_mean"] = torch.where(m, token_weight, 0.0).sum() / m.sum().clamp(min=1)
        return loss, metrics


def register() -> None:
    """The whole registration of the new algorithm (idempotent). The test process registers it for this
    module's tests only (the fixture below), the spawned pool worker at the start of ``_train``."""
    if NAME not in ALGORITHMS:
        ALGORITHMS.add(NAME, ProbWeightedGRPO.Config)


@pytest.fixture(scope="module", autouse=True)
def _registered_for_this_module():
    # Not at import: collecting this file must not register it (test_algorithms.py checks the exact built-in
    # names, whether this module runs before it, after it or is deselected, as in `make test-fast`).
    register()
    yield
    ALGORITHMS.remove(NAME)


RECIPE = {
    "model": {"architecture": dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False)},
    "algorithm": {"name": NAME, "params": {"clip_eps": 0.2}},
    "warmup": {"steps": 30, "batch_size": 32, "lr": 3e-3},
    "rollout": {"prompts_per_step": 8, "n": 4, "max_response_len": 4},
    "optim": {"lr": 1e-3},
    "train": {"steps": 2, "num_minibatches": 2, "val_every": 0},
    "checkpoint": {"every": 0, "save_at_end": False},
    "logging": {"tensorboard": False, "progress": False, "plots": False},
}


def _train(run_dir: str):
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import train

    register()  # in the spawned worker, which imported this module to find this function
    recipe = recipe_from_dict(RECIPE, overrides=[f"warmup.cache_dir={os.path.join(run_dir, 'warmup-cache')}"])
    device = distributed.initialize(recipe.parallel, seed=recipe.seed)
    try:
        rows = train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume="none",
                     log=lambda *a: None)
    finally:
        distributed.destroy()
    return rows, list(SEEN)


def test_the_registration_is_checked_like_a_built_in_one():
    from megatron_credit.recipe.config import recipe_from_dict

    algorithm = recipe_from_dict(RECIPE).algorithm.build()
    assert type(algorithm) is ProbWeightedGRPO
    assert algorithm.config == ProbWeightedGRPO.Config(clip_eps=0.2, floor=0.25)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['tau'\] in algorithm.params; valid: \['clip_eps', 'floor', 'norm_by_std'\]"):
        recipe_from_dict({**RECIPE, "algorithm": {"name": NAME, "params": {"tau": 4}}})


@pytest.mark.dist
def test_a_new_algorithm_with_a_side_channel_trains_two_iterations(tmp_path):
    with DistributedPool(world_size=1) as pool:
        rows, seen = pool.run(_train, str(tmp_path))[0]
    assert [r["step"] for r in rows] == [1, 2]
    passes = [i for i, s in enumerate(seen) if s[0] == "pass"]
    assert len(passes) == 2 and passes[0] == 0  # one behaviour pass per iteration, before its losses
    for it, row in enumerate(rows):
        start, end = passes[it], passes[it + 1] if it + 1 < len(passes) else len(seen)
        _, w, old_logp, mask = seen[start]
        # the side channel is the behaviour pass's own log-probs: w = max(exp(old_logp), 0.25) on the response
        assert torch.equal(w, torch.where(mask, old_logp.exp().clamp(min=0.25), 0.0)) and mask.any()
        assert ((w[mask] >= 0.25) & (w[mask] <= 1.0)).all() and (w[~mask] == 0).all()
        losses = [s for s in seen[start + 1:end] if s[0] == "loss"]
        assert len(losses) >= 2  # two mini-batches, each at least one micro-batch
        assert all(s[3] == 0.0 for s in losses)  # every micro-batch got its rows' weights, in place
        total, tokens = sum(s[1] for s in losses), sum(s[2] for s in losses)
        assert tokens == int(mask.sum())  # one epoch: every response token once
        assert row["weighted/token_weight_mean"] == pytest.approx(total / tokens, rel=1e-6)
        assert row["weighted/token_weight_mean"] == pytest.approx(float(w[mask].mean()), rel=1e-6)
        assert row["actor/grad_norm"] > 0 and row["actor/skipped_steps"] == 0
        assert math.isfinite(row["actor/pg_loss"]) and "fipo/weight_mean" not in row
