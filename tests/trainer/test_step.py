"""The trainer's update on a fixed global batch: sharding and micro-batching invariance (gloo).

A deterministic global batch (16 responses in groups of 4, ragged prompt and response lengths) goes
through the trainer's own parts (``behaviour_pass`` -> ``compute_advantages`` -> ``update_minibatch``
x 2 mini-batches) under each layout. The second mini-batch runs after the first optimizer step, so
``logp != old_logp`` there and FIPO's Future-KL weights and PPO's value clip are active. Each layout's
per-step loss, gradient norm and FIPO weights must equal world size 1 (fp32, rel 1e-5); the first
mini-batch must have ``logp == old_logp`` bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.fixed_batch import ARCH, _global_batch, _rows, _run_fixed


pool1 = module_pool(1)


pool2 = module_pool(2)


KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "fipo/weight_mean",
        "fipo/weight_max", "fipo/weight_std", "critic/value_loss", "critic/grad_norm")


def _assert_same(ref, got, what):
    for i, (a, b) in enumerate(zip(ref, got)):
        for k in KEYS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), f"{what} step {i} {k}: {b[k]} vs {a[k]}"


LAYOUTS = {"TP=2": {"tensor_model_parallel_size": 2},
           "TP=2+SP": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "PP=2": {"pipeline_model_parallel_size": 2},
           "CP=2": {"context_parallel_size": 2}, "DP=2": {}}


@pytest.mark.parametrize("algorithm", ["fipo", "ppo", "ppo:separate", "comppo"])
@pytest.mark.dist
def test_fixed_batch_update_is_invariant_to_the_layout(pool1, pool2, algorithm):
    # CompPO: gates and top-K keys from the final layer in the behaviour pass (heads split under TP, keys
    # gathered under CP), the TAC on the last stage (one fused layer: a PP=2 stage holds one of the two).
    # ppo:separate: the critic is a value model of its own, with its own schedules and optimizer step.
    kw = {"overrides": ["algorithm.params.critic_layers=1"]} if algorithm == "comppo" else {}
    if algorithm == "ppo:separate":
        algorithm, kw = "ppo", {"overrides": ["algorithm.params.critic=separate"]}
    ref = pool1.run(_run_fixed, {}, algorithm, **kw)[0]
    assert ref[0]["actor/logp_diff_abs"] == 0.0  # first mini-batch: logp == old_logp bit for bit
    assert ref[1]["actor/logp_diff_abs"] > 0 and ref[1]["actor/grad_norm"] > 0
    if algorithm == "fipo":
        assert ref[0]["fipo/weight_mean"] == 1.0 and ref[0]["fipo/weight_max"] == 1.0
        assert ref[0]["fipo/weight_std"] == 0.0
        assert ref[1]["fipo/weight_max"] > 1.0 and ref[1]["fipo/weight_std"] > 0.0  # the Future-KL weights act from the second mini-batch
    else:
        assert ref[1]["critic/value_loss"] > 0
    if kw.get("overrides") == ["algorithm.params.critic=separate"]:
        assert all(r["critic/grad_norm"] > 0 and r["critic/skipped_steps"] == 0 for r in ref)
    for name, layout in LAYOUTS.items():
        got = pool2.run(_run_fixed, layout, algorithm, **kw)[0]
        assert got[0]["actor/logp_diff_abs"] == 0.0, name
        _assert_same(ref, got, f"{algorithm} {name}")


@pytest.mark.parametrize("algorithm", ["dapo", "grpo", "dr_grpo", "gspo", "rloo"])
@pytest.mark.dist
def test_token_and_sequence_means_do_not_depend_on_micro_batching(pool1, algorithm):
    one = pool1.run(_run_fixed, {}, algorithm, max_tokens=4096)[0]
    four = pool1.run(_run_fixed, {}, algorithm, max_tokens=40)[0]  # 2 rows of <= 20 tokens each
    _assert_same(one, four, f"{algorithm} 1 vs many micro-batches")


@pytest.mark.dist
def test_data_parallel_sequence_mean_matches_world_size_one(pool1, pool2):
    _assert_same(pool1.run(_run_fixed, {}, "grpo")[0], pool2.run(_run_fixed, {}, "grpo")[0], "grpo DP=2")


@pytest.mark.dist
def test_a_non_finite_step_is_skipped_not_applied(pool1):
    out = pool1.run(_run_fixed, {}, "dapo", poison=0)[0]
    assert out[0]["actor/skipped_steps"] == 1.0 and not out[0]["changed"]
    assert out[1]["actor/skipped_steps"] == 0.0 and out[1]["changed"]


def _engine_disagrees(batch, plan):
    """The engine's log-probs: the trainer's minus log 3 on the first 3 responses of each mini-batch
    (ratio pi_old / pi_engine = 3, capped at C = 2), plus 0.5 on the next 2 (ratio e^-0.5), equal
    elsewhere. Returns the expected TIS metrics and first-step loss of each mini-batch."""
    rows = [[i for mb in mini for i in mb] for mini in plan]
    out = {}
    for k, r in enumerate(rows):
        batch.rollout_logp[r[:3]] = batch.old_logp[r[:3]] - math.log(3.0)
        batch.rollout_logp[r[3:5]] = batch.old_logp[r[3:5]] + 0.5
        batch.rollout_logp[r[5:]] = batch.old_logp[r[5:]]
        m = batch.loss_mask[r]
        w = torch.ones(m.shape, dtype=torch.float64)
        w[:3], w[3:5] = 2.0, math.exp(-0.5)
        n = m.sum().double()
        out[f"want/{k}/tis_weight_mean"] = float((w * m).sum() / n)
        out[f"want/{k}/tis_capped_frac"] = float(m[:3].sum() / n)
        # on-policy first step (ratio 1): token-mean of -A w
        out[f"want/{k}/pg_loss"] = float(-(batch.advantages[r].double() * w * m).sum() / n)
    return out


def _engine_agrees(batch, plan):
    batch.rollout_logp.copy_(batch.old_logp)
    return {}


@pytest.mark.dist
def test_truncated_importance_weights_reach_the_update_and_the_metrics(pool1):
    # algorithm.tis_cap: the loss of the first (on-policy) step is the token mean of -A min(pi_old/pi_engine, C),
    # and mismatch/tis_* report the weights; without the engine disagreeing, TIS changes nothing.
    out = pool1.run(_run_fixed, {}, "dapo", overrides=["algorithm.tis_cap=2.0"], prepare=_engine_disagrees)[0]
    for k, m in enumerate(out):
        assert m["mismatch/tis_weight_mean"] == pytest.approx(m[f"want/{k}/tis_weight_mean"], rel=1e-6)
        assert m["mismatch/tis_capped_frac"] == pytest.approx(m[f"want/{k}/tis_capped_frac"], rel=1e-6)
        assert 0 < m["mismatch/tis_capped_frac"] < 1
    assert out[0]["actor/pg_loss"] == pytest.approx(out[0]["want/0/pg_loss"], rel=1e-5, abs=1e-7)
    plain = pool1.run(_run_fixed, {}, "dapo")[0]
    same = pool1.run(_run_fixed, {}, "dapo", overrides=["algorithm.tis_cap=2.0"], prepare=_engine_agrees)[0]
    assert same[0]["mismatch/tis_weight_mean"] == 1.0 and same[0]["mismatch/tis_capped_frac"] == 0.0
    _assert_same(plain, same, "tis with an engine that agrees")
    assert out[0]["actor/pg_loss"] != pytest.approx(plain[0]["actor/pg_loss"], rel=1e-3)


MEGATRON_LAYOUTS = {"ws1": None, "DP=2": {}, "TP=2": {"tensor_model_parallel_size": 2},
                    "PP=2": {"pipeline_model_parallel_size": 2}}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["megatron", "megatron+distopt"])
@pytest.mark.dist
def test_megatron_optimizer_matches_the_local_one(pool1, pool2, distributed_optimizer):
    # optim.backend: megatron (get_megatron_optimizer; with the distributed optimizer the states and fp32
    # main params are sharded over DP) takes the same steps as the local AdamW: PPO (the value head in its
    # own lr group), weight decay on matrices only, the clip active (grad norms ~2 > 0.5), the lr schedule
    # (megatron's scheduler over either optimizer's groups) in its warm-up: lr / 3, then 2 lr / 3.
    common = ["optim.clip_grad=0.5", "optim.weight_decay=0.1", "optim.critic_lr=2e-3", "optim.warmup_steps=3",
              "optim.schedule=cosine", "optim.decay_steps=4", "optim.min_lr=1e-4"]
    ref = pool1.run(_run_fixed, {}, "ppo", overrides=common)[0]
    assert ref[1]["actor/grad_norm"] > 0.5 and ref[1]["critic/value_loss"] > 0
    assert [r["actor/lr"] for r in ref] == pytest.approx([1e-3, 2e-3], rel=1e-12)  # optim.lr 3e-3
    mine = common + ["optim.backend=megatron"] + (["optim.distributed_optimizer=true"] if distributed_optimizer else [])
    for name, layout in MEGATRON_LAYOUTS.items():
        pool = pool1 if layout is None else pool2
        got = pool.run(_run_fixed, layout or {}, "ppo", overrides=mine)[0]
        _assert_same(ref, got, f"megatron optimizer {name}")
        assert got[1]["changed"] and [r["actor/lr"] for r in got] == [r["actor/lr"] for r in ref]


OVERLAP = {"DP=2 local": ({}, ["optim.overlap_grad_reduce=true"]),
           "CP=2 local": ({"context_parallel_size": 2}, ["optim.overlap_grad_reduce=true"]),
           "PP=2 local": ({"pipeline_model_parallel_size": 2}, ["optim.overlap_grad_reduce=true"]),
           "DP=2 distopt": ({}, ["optim.backend=megatron", "optim.distributed_optimizer=true",
                                 "optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true"])}


@pytest.mark.parametrize("algorithm", ["ppo", "fipo"])
@pytest.mark.dist
def test_overlapped_gradient_reduction_and_parameter_gather_take_the_same_steps(pool1, pool2, algorithm):
    # megatron DDP's overlap_grad_reduce (asynchronous bucket reductions started in the backward of a
    # mini-batch's last micro-batch, the earlier ones under no_sync) and the distributed optimizer's
    # overlap_param_gather (the all-gather left to the next forward's pre-hooks) on gloo: the same losses
    # and gradient norms as world size 1, with several micro-batches per mini-batch (40 tokens each), and
    # the second step (after a deferred gather) sees the updated parameters of every shard.
    ref = pool1.run(_run_fixed, {}, algorithm, max_tokens=40)[0]
    assert ref[1]["actor/logp_diff_abs"] > 0
    for name, (layout, extra) in OVERLAP.items():
        got = pool2.run(_run_fixed, layout, algorithm, max_tokens=40, overrides=extra)[0]
        _assert_same(ref, got, f"{algorithm} overlap {name}")


def _overlap_is_real(parallel: dict):
    """The mechanisms are on, not just the flags: after one mini-batch's step with overlap_param_gather,
    parameters of the shard the other DP rank owns are still the old ones until ``gather_params`` (or the
    next forward); the gradient buckets were reduced through asynchronous handles."""
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer import step
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple
    from megatron_credit.metrics.sums import StatSums

    recipe = recipe_from_dict({"model": {"architecture": ARCH}, "parallel": parallel, "algorithm": {"name": "ppo"},
                               "rollout": {"prompts_per_step": 4, "n": 4, "max_response_len": 12},
                               "optim": {"lr": 3e-3, "backend": "megatron", "distributed_optimizer": True,
                                         "overlap_grad_reduce": True, "overlap_param_gather": True},
                               "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 40}})
    device = distributed.initialize(recipe.parallel, seed=1234)
    try:
        hf = recipe.model.hf_config()
        algorithm = recipe.algorithm.build()
        actor = Actor(hf_config=hf, **actor_settings(recipe), device=device, with_reference=False,
                      **algorithm.actor_options(hf, dtype=torch.float32))
        actor.load_initial_weights(seed=1234)
        ctx = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None, pad_id=0,
                      seq_multiple=seq_multiple(recipe.parallel))
        import torch.distributed as dist

        rows = [dist.get_rank() * 4 + k for k in range(4)] + [8 + dist.get_rank() * 4 + k for k in range(4)]
        batch = _rows(_global_batch(), rows)
        plan = step.plan_microbatches(ctx, batch)
        step.behaviour_pass(ctx, batch, plan)
        step.compute_advantages(ctx, batch)
        handles = []
        for group in actor.ddp.bucket_groups:  # record the asynchronous reduction handles as they are made
            original = group.start_grad_sync

            def start(*a, _g=group, _o=original, **k):
                _o(*a, **k)
                handles.append(_g.grad_reduce_handle is not None)
            group.start_grad_sync = start
        before = [p.detach().clone() for p in actor.model.parameters()]
        step.update_minibatch(ctx, batch, plan[0], StatSums())
        stale = [p.detach().clone() for p in actor.model.parameters()]
        actor.gather_params()
        after = [p.detach().clone() for p in actor.model.parameters()]
        unchanged_until_gather = sum(int(torch.equal(b, s) and not torch.equal(b, a))
                                     for b, s, a in zip(before, stale, after))
        return {"micro_batches": len(plan[0]), "async_handles": handles, "stale_until_gather": unchanged_until_gather}
    finally:
        distributed.destroy()


@pytest.mark.dist
def test_overlap_flags_turn_the_overlapped_mechanisms_on(pool2):
    for r in pool2.run(_overlap_is_real, {}):
        assert r["micro_batches"] > 1
        assert r["async_handles"] and all(r["async_handles"])
        assert r["stale_until_gather"] > 0  # the other rank's shard arrives with the gather


def test_overlapped_parameter_gather_needs_the_distributed_optimizer():
    from megatron_credit.recipe.config import recipe_from_dict

    with pytest.raises(ValueError, match="optim.overlap_param_gather: true needs optim.distributed_optimizer"):
        recipe_from_dict({}, overrides=["optim.backend=megatron", "optim.overlap_param_gather=true"])


@pytest.mark.dist
def test_megatron_optimizer_skips_a_non_finite_step(pool1):
    out = pool1.run(_run_fixed, {}, "dapo", poison=0, overrides=["optim.backend=megatron"])[0]
    assert out[0]["actor/skipped_steps"] == 1.0 and not out[0]["changed"]
    assert out[1]["actor/skipped_steps"] == 0.0 and out[1]["changed"]


def _refusal(overrides):
    try:
        _run_fixed({}, "comppo", overrides=overrides)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_megatron_optimizer_refuses_a_separately_clipped_critic(pool1):
    msg = pool1.run(_refusal, ["optim.backend=megatron"])[0]
    assert msg is not None and "optim.backend: megatron" in msg and "optim.backend: local" in msg


def _zero_advantages(batch, plan):
    batch.advantages.zero_()
    return {}


@pytest.mark.dist
def test_a_separate_critic_trains_like_a_trunk_head_without_policy_gradient(pool1):
    # With every advantage 0 the policy loss has no gradient, so PPO's trunk model (vf_coef 1, the trunk on
    # the critic's lr) is trained by the value loss alone: exactly what the separate value model is, built
    # from the same weights. Both steps must agree: the first (V = 0, only the zero-initialised head has a
    # gradient) and the second (the trunk too, through the head the first step moved).
    common = ["optim.critic_lr=3e-3", "optim.weight_decay=0.1", "optim.clip_grad=0.0"]
    trunk = pool1.run(_run_fixed, {}, "ppo", overrides=common + ["algorithm.params.vf_coef=1.0"],
                      prepare=_zero_advantages)[0]
    separate = pool1.run(_run_fixed, {}, "ppo", overrides=common + ["algorithm.params.critic=separate"],
                         prepare=_zero_advantages)[0]
    for i, (t, s) in enumerate(zip(trunk, separate)):
        assert s["critic/value_loss"] == pytest.approx(t["critic/value_loss"], rel=1e-6), i
        assert s["critic/grad_norm"] == pytest.approx(t["actor/grad_norm"], rel=1e-5), i
        assert s["actor/grad_norm"] == 0.0 and s["actor/pg_loss"] == 0.0  # the policy gets no value gradient
    assert trunk[1]["critic/value_loss"] != trunk[0]["critic/value_loss"]
    # With real advantages the policy's first step is the trunk run's without a value loss (vf_coef 0):
    # the separate critic leaves the policy's gradient alone.
    no_value = pool1.run(_run_fixed, {}, "ppo", overrides=["algorithm.params.vf_coef=0.0"])[0]
    plain = pool1.run(_run_fixed, {}, "ppo", overrides=["algorithm.params.critic=separate"])[0]
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss"):
        assert plain[0][k] == pytest.approx(no_value[0][k], rel=1e-6), k
    assert plain[0]["actor/grad_norm"] > 0 and plain[0]["changed"]


@pytest.mark.dist
def test_a_separate_critic_with_the_megatron_optimizer_matches_the_local_one(pool1, pool2):
    common = ["algorithm.params.critic=separate", "optim.critic_lr=2e-3", "optim.weight_decay=0.1",
              "optim.clip_grad=0.5", "optim.warmup_steps=3"]
    ref = pool1.run(_run_fixed, {}, "ppo", overrides=common)[0]
    assert ref[1]["critic/grad_norm"] > 0.5  # the critic's own clip is active
    # both models on their own peaks (lr 3e-3, critic_lr 2e-3), warming up over 3 steps
    assert [r["actor/lr"] for r in ref] == pytest.approx([1e-3, 2e-3], rel=1e-12)
    assert [r["critic/lr"] for r in ref] == pytest.approx([2e-3 / 3, 4e-3 / 3], rel=1e-12)
    for name, (pool, layout, extra) in {"ws1": (pool1, {}, []),
                                         "DP=2 distopt": (pool2, {}, ["optim.distributed_optimizer=true"])}.items():
        got = pool.run(_run_fixed, layout, "ppo", overrides=common + ["optim.backend=megatron", *extra])[0]
        _assert_same(ref, got, f"separate critic, megatron optimizer {name}")
        assert [r["critic/lr"] for r in got] == pytest.approx([r["critic/lr"] for r in ref], rel=1e-12)
