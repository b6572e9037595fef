"""Rollout routing replay (``moe.routing_replay``): the actor's routers send each token to the experts the
rollout engine sent it to.

The engine (the HF engine on the tiny Qwen3-MoE, its weights synced from the actor) samples and records
each token's experts; then the trainer's routers are perturbed, so that their own choices differ from the
engine's for some tokens. The behaviour pass then recomputes the sampled tokens' log-probs:

- replayed, they equal the engine's to the mismatch bound of an unperturbed run (the perturbation moves
  only the gate weights of the experts the engine chose);
- not replayed, the tokens routed elsewhere move them far more;
- ``moe/routing_agreement`` is 1 without the perturbation and below 1 with it, whether replayed or not.

The same replayed log-probs and agreement come out of every layout (TP = 2 with sequence parallelism, where
each TP rank routes its slice of the sequence; CP = 2; PP = 2; packed and padded micro-batches). Full
recompute (the router runs again in the backward, from the queue of targets) needs CUDA in megatron's
checkpoint (its RNG tracker): it is the ``gpu`` test below, and the queue's contract is pinned on the CPU in
``tests/trainer/test_routing_replay_unit.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.trainer.test_moe_expert_parallel import TINY_MOE

pytestmark = pytest.mark.dist

pool2 = module_pool(2)
PERTURB = 0.2  # relative size of the router weights' perturbation


def _setup(parallel: dict, overrides=()):
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.trainer.loop import Context, actor_settings, context_settings, seq_multiple

    recipe = recipe_from_dict({"model": {"architecture": TINY_MOE}, "parallel": parallel, "algorithm": {"name": "grpo"},
                               "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
                               "train": {"num_minibatches": 1, "max_tokens_per_microbatch": 64}},
                              overrides=list(overrides))
    device = distributed.initialize(recipe.parallel, seed=1234)
    hf = recipe.model.hf_config()
    algorithm = recipe.algorithm.build()
    actor = Actor(hf_config=hf, **actor_settings(recipe), device=device, with_reference=False,
                  **algorithm.actor_options(hf, dtype=torch.float32,
                                            pp_size=recipe.parallel.pipeline_model_parallel_size))
    actor.load_initial_weights(seed=1234)
    ctx = Context(**context_settings(recipe), algorithm=algorithm, actor=actor, rollouts=None, pad_id=0,
                  seq_multiple=seq_multiple(recipe.parallel))
    return recipe, hf, actor, ctx


def _samples(hf, actor):
    """The engine's samples of four prompts (two each), its weights the actor's (same on every rank)."""
    from megatron_credit.rollout.hf_engine import HFRolloutEngine
    from megatron_credit.rollout.types import SamplingParams

    engine = HFRolloutEngine(hf_config=hf)
    engine.update_weights(actor.hf_weight_buckets())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (5, 9, 3, 7)]
    return engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=11))


def _perturb(actor, scale: float) -> None:
    from megatron_credit.trainer.moe import routers

    for router in routers(actor.model):
        g = torch.Generator().manual_seed(100 + router.layer_number)  # the same on every rank
        w = router.weight
        with torch.no_grad():
            w += scale * w.detach().abs().mean() * torch.randn(w.shape, generator=g).to(w.device, w.dtype)


def _batch(samples):
    from megatron_credit.batch.train_batch import train_batch_from_rollout

    padded = samples.to_padded(pad_token_id=0)
    b = padded.input_ids.shape[0]
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0])[:b]  # mixed within each group of two
    return train_batch_from_rollout(padded, rewards=rewards, correct=rewards > 0, pad_id=0)


def _behaviour(ctx, samples, *, replay: bool):
    """The behaviour pass's log-probs ``[B, T]`` (last stage; None elsewhere), the batch, the agreement."""
    from megatron_credit.trainer import step
    from megatron_credit.metrics.sums import StatSums

    tb = _batch(samples)
    ctx.actor.routing_replay.replay = replay
    step.behaviour_pass(ctx, tb, step.plan_microbatches(ctx, tb))
    stats = StatSums()
    stats.add(ctx.actor.model_statistics())
    return tb, ctx.reduction(stats)["moe/routing_agreement"]


def replay_worker(parallel: dict, overrides=()):
    """Per layout: the largest |trainer - engine| log-prob over sampled tokens and the agreement, for the
    unperturbed router (replayed) and the perturbed one (replayed, not replayed); the replayed log-probs."""
    from megatron_credit import distributed

    _, hf, actor, ctx = _setup(parallel, overrides)
    try:
        samples = _samples(hf, actor)
        out = {}
        for name, replay in (("exact", True), ("replayed", True), ("own", False)):
            if name == "replayed":
                _perturb(actor, PERTURB)  # from here on the trainer's routers differ from the engine's
            tb, agreement = _behaviour(ctx, samples, replay=replay)
            if tb.old_logp is not None:
                m = tb.loss_mask
                diff = (tb.old_logp - tb.rollout_logp)[m].abs()
                out[name] = {"max": float(diff.max()), "mean": float(diff.mean()), "agreement": agreement,
                             "logp": torch.where(m, tb.old_logp, 0.0)}  # the sampled tokens only
        return out or None
    finally:
        distributed.destroy()


def update_worker(parallel: dict, overrides=(), replay: bool = True):
    """One update on the engine's samples with the perturbed router: rank 0's loss and gradient norm."""
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.trainer import step
    from megatron_credit.metrics.sums import StatSums

    _, hf, actor, ctx = _setup(parallel, overrides)
    try:
        samples = _samples(hf, actor)
        _perturb(actor, PERTURB)
        actor.routing_replay.replay = replay
        tb = _batch(samples)
        plan = step.plan_microbatches(ctx, tb)
        step.behaviour_pass(ctx, tb, plan)
        step.compute_advantages(ctx, tb)
        stats = StatSums()
        actor.reset_model_statistics()
        step.update_minibatch(ctx, tb, plan[0], stats)
        model_stats = actor.model_statistics()
        m = ctx.reduction(stats)
        m["slots"] = float(sum(v for k, v in model_stats.items() if k.startswith("sum:moe/tokens/")))
        computed = sum(mb.computed_tokens for mb in step.microbatch_cut(ctx).cut(tb, plan[0]))
        m["expected_slots"] = float(computed * TINY_MOE["num_experts_per_tok"] * TINY_MOE["num_hidden_layers"])
        return {k: m[k] for k in ("actor/pg_loss", "actor/grad_norm", "slots", "expected_slots")} \
            if dist.get_rank() == 0 else None
    finally:
        distributed.destroy()


LAYOUTS = {"tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, []),
           "cp2": ({"context_parallel_size": 2}, []), "pp2": ({"pipeline_model_parallel_size": 2}, []),
           "padded": ({}, ["train.packing=false"])}


@pytest.fixture(scope="module")
def base(pool2):
    """DP = 2, packed: both ranks hold the same samples (the engine's seeds are the run's)."""
    return pool2.run(replay_worker, {})[0]


def test_replay_gives_the_engines_log_probs_where_the_routers_own_choice_does_not(base):
    exact, replayed, own = base["exact"], base["replayed"], base["own"]
    # unperturbed: the trainer's routers pick what the engine picked, and the log-probs are the engine's
    assert exact["agreement"] == 1.0 and exact["max"] < 1e-5
    # perturbed: some (token, layer) pairs route elsewhere, replayed or not
    assert 0.5 < replayed["agreement"] == own["agreement"] < 1.0
    # replayed: within the fp32 mismatch bound (only the chosen experts' gate weights moved)
    assert replayed["mean"] < 1e-4
    # the router's own choice: an order of magnitude further
    assert own["mean"] > 10 * replayed["mean"] and own["max"] > 10 * replayed["max"]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_replay_is_the_same_under_every_layout(pool2, base, name):
    parallel, overrides = LAYOUTS[name]
    got = next(r for r in pool2.run(replay_worker, parallel, overrides) if r is not None)  # the last stage's
    for case in ("exact", "replayed", "own"):
        assert got[case]["agreement"] == pytest.approx(base[case]["agreement"], abs=1e-12), case
        assert torch.allclose(got[case]["logp"], base[case]["logp"], atol=2e-6, rtol=0), case


def test_an_update_replays_too(pool2):
    """The update's forward replays as the behaviour pass's did: its first mini-batch is on-policy, so the
    ratio is 1 (no PPO clipping) and the loss's gradient flows through the replayed experts' gates."""
    on = pool2.run(update_worker, {}, [], True)[0]
    off = pool2.run(update_worker, {}, [], False)[0]
    assert on["actor/grad_norm"] > 0 and off["actor/grad_norm"] > 0
    assert on["actor/grad_norm"] != pytest.approx(off["actor/grad_norm"], rel=1e-4)


pool1 = module_pool(1)


def test_the_expert_loads_count_every_token_once_under_sequence_parallelism(pool2):
    """TP 2 with sequence parallelism: each TP rank routes half of the sequence, and the update's expert
    loads (``moe/expert_load_max_frac``'s counts) are summed over the TP ranks: every routed slot of the
    micro-batches once (padding included), as at TP 1."""
    for parallel in ({}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}):
        got = pool2.run(update_worker, parallel, [])[0]
        assert got["slots"] == got["expected_slots"] > 0, parallel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: megatron's activation checkpoint saves the CUDA RNG state (no GPU here)")
def test_full_recompute_replays_in_the_backward(pool1):
    """Full recompute runs each layer again in the backward: the router takes the queued targets of the
    micro-batch being recomputed, so the update equals the one without recompute."""
    plain = pool1.run(update_worker, {}, [])[0]
    recomputed = pool1.run(update_worker, {}, ["train.recompute=full"])[0]
    for k, v in plain.items():
        assert recomputed[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
