"""The fixed global batch of the trainer's update tests and the run that takes two optimizer steps on it
(``_run_fixed``, inside a ``DistributedPool`` worker): shared by tests/trainer/test_step.py (sharding and
micro-batching invariance) and tests/trainer/test_device_placement.py (the same update on an emulated
accelerator)."""
from __future__ import annotations

import math

import torch

ARCH = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
B, GROUP, T = 16, 4, 24


def _global_batch():
    from megatron_credit.batch.train_batch import TrainBatch

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(4, 9, (B,), generator=g)
    resp = torch.randint(3, 13, (B,), generator=g)
    lens = prompt + resp
    ids = torch.randint(1, 128, (B, T), generator=g)
    pos = torch.arange(T)
    ids = torch.where(pos[None] < lens[:, None], ids, 0)
    labels = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], dim=1)
    mask = (pos[None] >= prompt[:, None] - 1) & (pos[None] < lens[:, None] - 1)
    correct = torch.rand(B, generator=g) < 0.5
    return TrainBatch(input_ids=ids, labels=labels, loss_mask=mask, rollout_logp=torch.zeros(B, T),
                      seq_lens=lens, group_ids=torch.arange(B) // GROUP,
                      rewards=correct.float() * 2 - 1, correct=correct)


def _rows(batch, rows):
    import dataclasses

    idx = torch.tensor(rows)
    return dataclasses.replace(batch, **{f: getattr(batch, f)[idx] for f in (
        "input_ids", "labels", "loss_mask", "rollout_logp", "seq_lens", "group_ids", "rewards", "correct")})


def _run_fixed(parallel: dict, algorithm: str, *, max_tokens: int = 4096, overrides=(), poison=None,
               prepare=None, before=None, arch=None):
    """Two optimizer steps of ``algorithm`` on the fixed batch under ``parallel``; rank 0's metrics.
    ``prepare(batch, plan)``, if given, edits the batch after the advantages and returns a dict added to
    each step's metrics (expected values computed from the batch); ``before(batch)`` edits it before the
    behaviour pass (what the rollout side hands over: the engine's log-probs, the versions). ``arch``: another
    model than :data:`ARCH` (its vocabulary at least 128: the batch's token ids)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple
    from megatron_credit.metrics.sums import StatSums

    recipe = recipe_from_dict({"model": {"architecture": arch or ARCH}, "parallel": parallel,
                               "algorithm": {"name": algorithm},
                               "rollout": {"prompts_per_step": 4, "n": 4, "max_response_len": 12},
                               "optim": {"lr": 3e-3, "clip_grad": 0.0},
                               "train": {"num_minibatches": 2, "max_tokens_per_microbatch": max_tokens}},
                              overrides=list(overrides))
    device = distributed.initialize(recipe.parallel, seed=1234)
    try:
        hf = recipe.model.hf_config()
        algorithm = recipe.algorithm.build()
        actor = Actor(hf_config=hf, **actor_settings(recipe), device=device, with_reference=False,
                      **algorithm.actor_options(hf, dtype=torch.float32,
                                                pp_size=recipe.parallel.pipeline_model_parallel_size))
        from megatron_credit.trainer.critic_model import build_separate_critic, init_critic_from

        critic = build_separate_critic(hf, algorithm, device=device, **actor_settings(recipe))
        actor.load_initial_weights(seed=1234)
        if critic is not None:
            init_critic_from(critic, actor)
        ctx = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None, pad_id=0,
                      seq_multiple=seq_multiple(recipe.parallel), critic=critic)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        # Mini-batch i of the global batch = rows [8i, 8i + 8): each DP rank takes its share of each
        # (whole groups of 4), so both layouts see the same global mini-batches.
        per, half = B // dp, B // 2 // dp
        rows = [i * (B // 2) + dp_rank * half + k for i in range(2) for k in range(half)]
        assert len(rows) == per
        batch = _rows(_global_batch(), rows)
        if before is not None:
            before(batch)
        plan = step.plan_microbatches(ctx, batch)
        step.behaviour_pass(ctx, batch, plan)
        step.compute_advantages(ctx, batch)
        if poison is not None and batch.advantages is not None:
            batch.advantages[plan[poison][0][0], :] = math.nan
        extra = prepare(batch, plan) if prepare is not None else {}
        out = []
        for mini in plan:
            before = [p.detach().clone() for p in actor.model.parameters()]
            stats = StatSums()
            step.update_minibatch(ctx, batch, mini, stats)
            m = ctx.reduction(stats)
            m["changed"] = any(not torch.equal(a, p) for a, p in zip(before, actor.model.parameters()))
            # which parameters moved: a LoRA run's frozen base must not (models/lora.py)
            m["base_changed"] = any(not torch.equal(a, p) for a, (n, p) in zip(before, actor.model.named_parameters())
                                    if ".lora." not in n and not n.startswith("value_head."))
            m["actor/lr"] = actor.last_lr
            if critic is not None:
                m["critic/lr"] = critic.last_lr
            m.update(extra)
            out.append(m)
        return out if dist.get_rank() == 0 else None
    finally:
        distributed.destroy()
