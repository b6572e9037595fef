"""AdamW on fp32 master weights: plain AdamW for fp32 models, exact fp32 arithmetic for bf16 ones, and a
bf16 run that resumes bit-identically (the masters travel in the checkpoint). The learning-rate schedule
(megatron's OptimizerParamScheduler) against a step-by-step loop, and its resume check."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_credit.trainer.optimizer import MasterWeightsAdamW


def _grads(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * 1e-3 for _ in range(6)]


def test_fp32_model_is_plain_adamw_bit_for_bit():
    a = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MasterWeightsAdamW([{"params": [a], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.99))
    ref = torch.optim.AdamW([{"params": [b], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.99))
    assert not ours.mixed and ours.masters[0] is a
    for g in _grads(1, (5, 3)):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step(), ref.step()
        ours.zero_grad(), ref.zero_grad()
        assert torch.equal(a, b)


def test_bf16_model_steps_fp32_masters_and_keeps_small_updates():
    init = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.02
    w = torch.nn.Parameter(init.to(torch.bfloat16))
    master_ref = torch.nn.Parameter(w.detach().float().clone())  # fp32 AdamW fed the same grads
    plain = torch.nn.Parameter(w.detach().clone())  # plain AdamW on the bf16 weights
    ours = MasterWeightsAdamW([{"params": [w]}], lr=1e-6, weight_decay=0.0)
    ref = torch.optim.AdamW([master_ref], lr=1e-6, weight_decay=0.0)
    bad = torch.optim.AdamW([plain], lr=1e-6, weight_decay=0.0)
    start = w.detach().clone()
    for step in range(60):
        g = torch.ones(64).to(torch.bfloat16)
        w.grad, master_ref.grad, plain.grad = g.clone(), g.float(), g.clone()
        ours.step(), ref.step(), bad.step()
        ours.zero_grad(), ref.zero_grad(), bad.zero_grad()
        assert torch.equal(ours.masters[0], master_ref)  # exact fp32 AdamW
        assert torch.equal(w, master_ref.detach().to(torch.bfloat16))  # the model holds the rounded master
    assert (w != start).sum() > 10  # 60 updates of 1e-6 survive in the masters and reach the weights
    assert torch.equal(plain, start)  # ...while plain bf16 AdamW rounds every one of them away


@pytest.mark.dist
def test_bf16_run_resumes_bit_identically(tmp_path):
    from tests.support.runs import CLI_TINY, metrics_rows, run_pretrain_rl, stable

    args = [*CLI_TINY, "model.params_dtype=bfloat16"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run_pretrain_rl("--output-dir", a, *args, "train.steps=4").returncode == 0
    assert run_pretrain_rl("--output-dir", b, *args, "train.steps=2").returncode == 0
    proc = run_pretrain_rl("--output-dir", b, *args, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    assert stable(metrics_rows(a)) == stable(metrics_rows(b))
    with open(os.path.join(b, "checkpoints", "iter_0000004", "meta.json")) as f:
        assert json.load(f)["step"] == 4


# --- the learning-rate schedule: megatron's OptimizerParamScheduler (trainer/schedule.py) ------

def _schedule_loop(k: int, peak: float, floor: float, warmup: int, decay: int, style: str) -> float:
    """The documented schedule, step by step: lr of optimizer step ``k`` (0-based)."""
    if k < warmup:
        return peak * (k + 1) / warmup
    if style == "constant":
        return peak
    j = k - warmup + 1  # steps into the decay, counting this one
    if j >= decay:
        return floor
    r = j / decay
    coeff = 1 - r if style == "linear" else 0.5 * (math.cos(math.pi * r) + 1)
    return floor + coeff * (peak - floor)


def _groups(o):
    from megatron_credit.trainer.schedule import critic_schedule

    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    policy = {"max_lr": o.lr, "min_lr": o.min_lr}
    return torch.optim.AdamW([{"params": [ps[0]], "wd_mult": 1.0, **policy},
                              {"params": [ps[1]], "wd_mult": 0.0, **policy},
                              {"params": [ps[2]], "wd_mult": 0.0, **critic_schedule(o), "name": "critic"}], lr=o.lr)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_schedule_is_megatrons_scheduler_at_the_documented_steps(style, warmup):
    from megatron_credit.trainer.schedule import build_scheduler
    from megatron_credit.recipe.sections import OptimConfig

    o = OptimConfig(lr=1e-3, min_lr=1e-4, critic_lr=4e-3, weight_decay=0.1, warmup_steps=warmup, schedule=style,
                    decay_steps=0 if style == "constant" else 5)
    opt = _groups(o)
    sched = build_scheduler(opt, o)
    assert type(sched).__mro__[1].__name__ == "OptimizerParamScheduler"
    seen = []
    for k in range(12):
        sched.num_steps = k  # k optimizer steps taken: the actor's optimizer_steps
        sched.step(0)
        want = _schedule_loop(k, 1e-3, 1e-4, warmup, 5, style)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), (k, style, warmup)
        assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]
        # the value head: the same schedule from critic_lr down to min_lr x critic_lr / lr
        assert opt.param_groups[2]["lr"] == pytest.approx(4 * want, rel=1e-12)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0]
        seen.append(want)
    if warmup:
        assert seen[0] == pytest.approx(1e-3 / 3) and seen[2] == pytest.approx(1e-3)  # no step at lr 0
    if style != "constant":
        assert seen[warmup + 4] == pytest.approx(1e-4) and seen[-1] == pytest.approx(1e-4) and seen[warmup] < 1e-3
    # the state megatron checkpoints, loaded into a fresh scheduler, continues at the same step
    fresh_opt = _groups(o)
    fresh = build_scheduler(fresh_opt, o)
    fresh.num_steps = 0
    fresh.load_state_dict(sched.state_dict())
    assert fresh.num_steps == 11 and [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]


def test_a_resumed_schedule_that_differs_is_refused_naming_the_fields():
    from types import SimpleNamespace

    from megatron_credit.trainer.schedule import build_scheduler
    from megatron_credit.trainer.checkpoint import _check_schedule
    from megatron_credit.recipe.sections import OptimConfig

    def actor(with_critic=False, **kw):
        o = OptimConfig(**{"lr": 1e-3, "warmup_steps": 2, **kw})
        return SimpleNamespace(scheduler=build_scheduler(_groups(o), o), optim=o,
                               with_critic=with_critic)

    meta = {"opt_param_scheduler": actor().scheduler.state_dict(), "critic_lr": 1e-3}
    _check_schedule("ckpt", meta, actor())  # the same schedule: fine
    _check_schedule("ckpt", {}, actor(min_lr=1e-4))  # a checkpoint without a saved schedule: position only
    with pytest.raises(ValueError) as e:
        _check_schedule("ckpt", meta, actor(min_lr=1e-4, warmup_steps=5, schedule="cosine", decay_steps=7))
    msg = str(e.value)
    for part in ("--resume ckpt", "optim.min_lr: checkpoint 0.0, recipe 0.0001", "optim.warmup_steps: checkpoint 2, "
                 "recipe 5", "optim.schedule: checkpoint 'constant', recipe 'cosine'", "optim.resume_schedule=recipe"):
        assert part in msg, msg
    assert "optim.lr:" not in msg and "optim.weight_decay" not in msg
    assert "optim.decay_steps" not in msg  # a constant schedule has no decay length to compare
    _check_schedule("ckpt", meta, actor(critic_lr=2e-3))  # no critic: its lr is not part of the run
    with pytest.raises(ValueError, match=r"optim.critic_lr: checkpoint 0.001, recipe 0.002"):
        _check_schedule("ckpt", meta, actor(with_critic=True, critic_lr=2e-3))
    with pytest.raises(ValueError, match=r"optim.warmup_steps \+ optim.decay_steps: checkpoint 5, recipe 6"):
        _check_schedule("ckpt", {"opt_param_scheduler": actor(schedule="linear", decay_steps=3).scheduler.state_dict()},
                        actor(schedule="linear", decay_steps=4))
    _check_schedule("ckpt", meta, actor(min_lr=1e-4, resume_schedule="recipe"))  # the user's choice: allowed
