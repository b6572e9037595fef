"""CompPO through the trainer: gates from the final layer's attention in the behaviour pass, the TAC /
standard critic, the gate controls, the critic warm-up, the phase controller's knobs, and two iterations
of ``comppo`` and ``comppo_fipo`` at world size 1, TP=2, PP=2 and CP=2 on gloo (same numbers)."""
from __future__ import annotations

import dataclasses
import math
import os
import types

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.runs import VOLATILE, metrics_rows, run_pretrain_rl, stable, train_tiny

LAYOUTS = {"TP=2": ["parallel.tensor_model_parallel_size=2"], "PP=2": ["parallel.pipeline_model_parallel_size=2"],
           "CP=2": ["parallel.context_parallel_size=2"]}
# Decided before the iteration's first optimizer step: equal up to float rounding in every layout. The
# gates come from fp32 attention scores through two log-sum-exps and c = (H - 1/n) / (1 - 1/n), which
# cancels near the envelope's floor (these gates are ~0.2): TP=2 and CP=2 move them by up to 1.3e-5
# relative here (PP=2: 0), so they are compared at 5e-5; a lost key chunk or head moves them by > 1e-2.
BEFORE_UPDATE = ("reward/mean", "comppo/gate_mean", "comppo/gate_first_third", "comppo/gate_last_third",
                 "critic/value_mae")
BEFORE_UPDATE_REL = 5e-5
# Averaged over both mini-batches, the second after an AdamW step. Adam's first step moves each weight by
# about +-lr whatever its gradient's size, so float-rounding differences of tiny gradients between layouts
# become lr-sized weight differences (PPO shows the same ~0.3% here): a loose check. The update itself is
# compared at 1e-5 on a fixed batch in tests/trainer/test_step.py.
AFTER_UPDATE = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/value_loss", "critic/grad_norm")


pool1 = module_pool(1)


pool2 = module_pool(2)


@pytest.mark.parametrize("algorithm", ["comppo", "comppo_fipo"])
@pytest.mark.dist
def test_comppo_trains_two_iterations_with_the_same_numbers_in_every_layout(pool1, pool2, tmp_path, algorithm):
    base = [f"algorithm.name={algorithm}", "algorithm.params.critic_layers=2",
            "model.architecture.num_hidden_layers=4"]  # 2 layers per stage at PP=2: the same TAC everywhere
    ref = pool1.run(train_tiny, str(tmp_path / "ws1"), "none", base)[0]
    assert [r["step"] for r in ref] == [1, 2]
    for r in ref:
        assert 0.1 < r["comppo/gate_mean"] < 0.9, r["comppo/gate_mean"]
        for k in ("comppo/gate_first_third", "comppo/gate_mid_third", "comppo/gate_last_third"):
            assert 0.1 <= r[k] <= 0.9
        for k in ("critic/value_loss", "critic/explained_var", "critic/value_mae", "critic/clamp_frac",
                  "critic/grad_norm"):
            assert math.isfinite(r[k]), k
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
    # The critic starts at V = 0 (zero-initialised outputs): its first behaviour-pass values are all 0, so
    # its mean absolute error to the returns is the mean absolute return.
    assert ref[0]["critic/clamp_frac"] == 0.0
    assert math.isnan(ref[0]["critic/spearman"])  # constant values have no ranks
    assert -1.0 <= ref[1]["critic/spearman"] <= 1.0  # the critic has learned something after one iteration
    for name, layout in LAYOUTS.items():
        got = pool2.run(train_tiny, str(tmp_path / name), "none", base + layout)[0]
        # Iteration 1 samples the same responses in every layout (same weights, same seeds); iteration 2
        # samples from weights that differ by float rounding, so only iteration 1 is compared.
        for keys, rel in ((BEFORE_UPDATE, BEFORE_UPDATE_REL), (AFTER_UPDATE, 2e-2)):
            for k in keys:
                assert got[0][k] == pytest.approx(ref[0][k], rel=rel, abs=1e-6), f"{name} {k}: {got[0][k]} vs {ref[0][k]}"


def _fake_ctx(algorithm: str, overrides: dict, *, feature_critic: bool = False):
    from megatron_credit.algorithm.catalog import ALGORITHMS
    from megatron_credit.algorithm.knobs import StepKnobs

    alg = ALGORITHMS.get(algorithm).from_mapping(overrides).build()
    alg.start(seed=0, dp_rank=0)
    actor = types.SimpleNamespace(with_critic=True, feature_critic=feature_critic)
    return types.SimpleNamespace(algorithm=alg, knobs=StepKnobs(kl_coef=0.0), actor=actor, whiten=None)


def _batch(b=4, t=10, seed=0):
    from megatron_credit.batch.train_batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([10, 8, 6, 9])[:b]
    mask = (torch.arange(t)[None] >= 2) & (torch.arange(t)[None] < (lens[:, None] - 1))
    return TrainBatch(input_ids=torch.zeros(b, t, dtype=torch.long), labels=torch.zeros(b, t, dtype=torch.long),
                      loss_mask=mask, rollout_logp=torch.zeros(b, t), seq_lens=lens,
                      group_ids=torch.arange(b) // 2, rewards=torch.randn(b, generator=g),
                      correct=torch.zeros(b, dtype=torch.bool), old_logp=torch.zeros(b, t),
                      values=torch.rand(b, t, generator=g) * 2 - 1,
                      extras={"kappa": torch.rand(b, t, generator=g) * 0.8 + 0.1})


def test_a_constant_gate_equal_to_gamma_gives_ppo_gae_exactly():
    from megatron_credit.trainer.step import compute_advantages

    gamma, lam = 0.61, 0.9
    comp = _fake_ctx("comppo", {"gate_control": "fixed", "fixed_gate": gamma, "lam": lam, "adv_clip": None})
    ppo = _fake_ctx("ppo", {"gamma": gamma, "lam": lam, "whiten_advantages": False})
    a, b = _batch(), _batch()
    compute_advantages(comp, a)
    compute_advantages(ppo, b)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    assert a.advantages.abs().sum() > 0


def test_critic_warmup_keeps_values_out_of_the_advantages():
    from megatron_credit.credit.gae import comp_gae
    from megatron_credit.trainer.step import compute_advantages

    ctx = _fake_ctx("comppo", {"critic_warmup_steps": 2, "adv_clip": None})
    for iteration, trusted in ((1, False), (2, False), (3, True)):
        batch = _batch()
        compute_advantages(ctx, batch, iteration)
        values = batch.values if trusted else torch.zeros_like(batch.values)
        adv, ret = comp_gae(batch.token_rewards(), values, batch.extras["gates"], batch.loss_mask, lam=0.95)
        assert torch.equal(batch.advantages, adv) and torch.equal(batch.returns, ret), iteration
        assert torch.equal(batch.extras["gates"], torch.where(batch.loss_mask, batch.extras["kappa"], 0.0))


def test_advantage_clip_and_gate_controls_reach_the_estimator():
    from megatron_credit.trainer.step import compute_advantages

    clipped = _fake_ctx("comppo", {"adv_clip": 0.05})
    batch = _batch()
    compute_advantages(clipped, batch)
    assert batch.advantages.abs().max() <= 0.05 + 1e-7 and (batch.advantages.abs() == 0.05).any()
    shuffled = _fake_ctx("comppo", {"gate_control": "shuffle"})
    batch = _batch()
    compute_advantages(shuffled, batch)
    m = batch.loss_mask
    assert torch.equal(batch.extras["gates"][m].sort().values, batch.extras["kappa"][m].sort().values)
    assert not torch.equal(batch.extras["gates"][m], batch.extras["kappa"][m]) and (batch.extras["gates"][~m] == 0).all()


def test_position_control_collects_then_freezes_and_survives_a_checkpoint():
    from megatron_credit.algorithm.comppo import CompPO
    from megatron_credit.algorithm.gate_controls import GateControl

    params = CompPO.Config(gate_control="position", position_steps=2, position_bins=4)
    gc = GateControl(params, seed=0, dp_rank=0)
    b1, b2, b3 = _batch(seed=1), _batch(seed=2), _batch(seed=3)
    for i, b in enumerate((b1, b2), start=1):  # collecting: the dynamic gates are used meanwhile
        assert torch.equal(gc.gates(b.extras["kappa"], b.loss_mask, iteration=i), torch.where(b.loss_mask, b.extras["kappa"], 0.0))
    restored = GateControl(params, seed=0, dp_rank=0)
    restored.load_state_dict(gc.state_dict())
    g = gc.gates(b3.extras["kappa"], b3.loss_mask, iteration=3)
    assert torch.equal(g, restored.gates(b3.extras["kappa"], b3.loss_mask, iteration=3))
    # Frozen: the same gate for every token in the same bin of relative position, whatever kappa is.
    assert not torch.equal(g, torch.where(b3.loss_mask, b3.extras["kappa"], 0.0))
    assert len(torch.unique(g[b3.loss_mask])) <= 4


def _in_phase(algorithm, phase: str):
    """``algorithm`` (phase controller on) after a checkpoint whose controller is in ``phase``."""
    state = algorithm.phase.state_dict()
    algorithm.load_state_dict({"phase": {**state, "phase": phase}})
    assert algorithm.phase.phase == phase
    return algorithm


def test_phase_knobs_follow_the_papers_table():
    from megatron_credit.algorithm.knobs import phase_knobs
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import context_settings

    # The paper's stable settings: every phase gets exactly Table 14's numbers.
    recipe = recipe_from_dict({"algorithm": {"name": "comppo", "kl_coef": 0.002, "params": {"phase_controller": True}},
                               "optim": {"lr": 1e-6, "clip_grad": 1.0}, "train": {"epochs": 2}})
    base = context_settings(recipe)["base_knobs"]  # the recipe's own knobs
    assert phase_knobs(base, "stable") == dataclasses.replace(base, critic_clip_grad=1.0)
    expect = {"warning": (0.0035, 0.16, 7e-7, 0.4, 0.9, 4.0, 0.8, 2), "strong": (0.0045, 0.14, 5e-7, 0.3, 0.7, 3.5, 0.7, 2),
              "hard_stop": (0.0070, 0.09, 2e-7, 0.2, 0.5, 2.5, 0.5, 1)}
    for phase, (kl, clip, lr, vclip, cmult, aclip, gclip, epochs) in expect.items():
        alg = _in_phase(recipe.algorithm.build(), phase)
        k, c = alg.knobs(base), alg.config
        assert k == phase_knobs(base, phase) and k.phase == phase and k.epochs == epochs
        for got, want in ((k.kl_coef, kl), (c.clip_eps, clip), (1e-6 * k.lr_scale, lr),
                          (c.value_clip, vclip), (k.critic_lr_scale, cmult), (c.adv_clip, aclip),
                          (k.clip_grad, gclip), (k.critic_clip_grad, gclip)):
            assert got == pytest.approx(want, rel=1e-12), (phase, got, want)
        assert alg.recipe_config.clip_eps == 0.2  # the recipe's config is never changed
    # comppo_fipo: both clip ranges move by the same ratio.
    from megatron_credit.algorithm.comppo import CompFIPO

    c = _in_phase(CompFIPO.Config(phase_controller=True).build(), "strong").config
    assert (c.clip_low, c.clip_high) == pytest.approx((0.2 * 0.7, 0.28 * 0.7))


COMPPO_CLI = ["warmup.steps=0", "train.val_every=0", "rollout.prompts_per_step=8", "logging.progress=false",
              "logging.plots=false", "algorithm.name=comppo", "algorithm.params.gate_control=position",
              "algorithm.params.position_steps=1", "algorithm.params.phase_controller=true",
              "algorithm.params.critic_layers=2", "checkpoint.every=2"]


@pytest.mark.dist
def test_comppo_resume_continues_bit_identically(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_pretrain_rl("--output-dir", a, *COMPPO_CLI, "train.steps=4").returncode == 0
    proc = run_pretrain_rl("--output-dir", b, *COMPPO_CLI, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_pretrain_rl("--output-dir", b, *COMPPO_CLI, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    rows_a, rows_b = stable(metrics_rows(a)), stable(metrics_rows(b))
    assert rows_a == rows_b and [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert all("phase/level" in r and "comppo/gate_mean" in r for r in rows_a)
    assert os.path.isdir(os.path.join(b, "checkpoints", "iter_0000004"))


PPO_EQUIV = ["algorithm.name=comppo", "algorithm.params.gate_control=fixed", "algorithm.params.fixed_gate=1.0",
             "algorithm.params.critic=trunk", "algorithm.params.value_clip=0.2", "algorithm.params.adv_clip=null",
             "algorithm.params.whiten_advantages=true"]


@pytest.mark.dist
def test_a_constant_gate_equal_to_gamma_reproduces_ppo_bit_for_bit(pool1, tmp_path):
    """The papers' sanity check through the whole trainer: CompPO with kappa = gamma = 1 and PPO's critic
    and settings gives PPO's run exactly (the attention capture changes no number)."""
    ppo = pool1.run(train_tiny, str(tmp_path / "ppo"), "none", ["algorithm.name=ppo"])[0]
    comp = pool1.run(train_tiny, str(tmp_path / "comppo"), "none", PPO_EQUIV)[0]
    assert len(ppo) == len(comp) == 2
    for a, b in zip(ppo, comp):
        shared = [k for k in a if k in b and not k.startswith(VOLATILE)]
        assert len(shared) > 15
        assert {k: a[k] for k in shared} == {k: b[k] for k in shared}
        assert b["comppo/transport_mean"] == 1.0 and b["comppo/gate_mean"] < 1.0


def test_fusing_the_old_log_probs_is_refused_for_an_algorithm_that_captures():
    from megatron_credit.algorithm.comppo import CompPO
    from megatron_credit.trainer.step import fused_old_logprob

    capture = CompPO.Config().build().actor_options(types.SimpleNamespace(hidden_size=8, num_hidden_layers=2),
                                                    dtype=torch.float32)["capture"]
    assert set(capture.outputs) == {"kappa", "concentration", "topk_idx", "topk_w"}
    ctx = types.SimpleNamespace(train=types.SimpleNamespace(fuse_old_logprob=True),
                                knobs=types.SimpleNamespace(epochs=1), algorithm=CompPO.Config().build(),
                                actor=types.SimpleNamespace(capture=capture, with_critic=False))
    with pytest.raises(ValueError, match=r"^train\.fuse_old_logprob: this algorithm reads the behaviour pass's "
                                         r"forward \(its capture\); set train\.fuse_old_logprob=false$"):
        fused_old_logprob(ctx)
    ctx.actor.capture = None
    assert fused_old_logprob(ctx)


def test_the_algorithm_state_round_trips_and_a_checkpoint_with_its_parts_at_the_top_level_loads():
    """CompPO's state (its position gate control and its phase controller) saved by ``state_dict`` and
    loaded into a fresh build gives the same gates and the same clips in force; a checkpoint written before
    the state was saved whole (its parts next to ``prompts`` and ``rng``) loads the same way."""
    from megatron_credit.algorithm.comppo import CompPO
    from megatron_credit.algorithm.knobs import StepKnobs

    config = CompPO.Config(gate_control="position", position_steps=1, position_bins=4, phase_controller=True)
    saved = config.build()
    saved.start(seed=0, dp_rank=0)
    b1, b2 = _batch(seed=1), _batch(seed=2)
    saved.advantage_inputs(b1.extras, b1.loss_mask, 1)  # collects, then freezes the schedule
    for _ in range(3):  # a clip fraction past every level: the controller escalates
        saved.after_iteration({"actor/clipfrac_high": 0.5, "actor/clipfrac_low": 0.0})
    assert saved.phase.phase != "stable" and saved.config.clip_eps < config.clip_eps
    for state in (saved.state_dict(), {"prompts": {}, "rng": {}, **saved.state_dict()}):
        fresh = config.build()
        fresh.start(seed=0, dp_rank=0)
        fresh.load_state_dict(state)
        assert fresh.phase.phase == saved.phase.phase and fresh.config == saved.config
        assert fresh.knobs(StepKnobs(kl_coef=1.0)) == saved.knobs(StepKnobs(kl_coef=1.0))
        got, _ = fresh.advantage_inputs(b2.extras, b2.loss_mask, 2)
        want, _ = saved.advantage_inputs(b2.extras, b2.loss_mask, 2)
        assert torch.equal(got["gates"], want["gates"])
