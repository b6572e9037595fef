"""The learning-rate schedule of both optimizer backends: megatron-core's ``OptimizerParamScheduler`` over
param groups that carry megatron's ``max_lr`` / ``min_lr`` / ``wd_mult`` keys, and the per-step write of
each group's lr and weight decay (with the step knobs' scales on top).

A megatron adapter by design: it wraps megatron's ``OptimizerParamScheduler`` (its state is what
checkpoints save), so it imports megatron; only ``actor.py`` calls it."""
from __future__ import annotations

import math
from typing import Optional


def critic_schedule(o) -> dict[str, float]:
    """The value head's ``max_lr`` / ``min_lr``: the policy's schedule scaled by ``critic_lr / lr``."""
    return {"max_lr": o.critic_lr, "min_lr": o.min_lr * o.critic_lr / o.lr}


def build_scheduler(optimizer, o):
    """megatron's ``OptimizerParamScheduler`` over ``optimizer``'s groups for ``OptimConfig`` ``o``.

    Its ``num_steps`` counts the optimizer steps taken (what checkpoints save). The lr of step ``k``
    (0-based) is the schedule's value at ``k + 1``: warm-up ``lr * (k + 1) / W`` (megatron's own loop uses
    ``init_lr`` = 0 for the first step, a wasted step), then constant, or ``linear`` / ``cosine`` from
    ``lr`` down to ``min_lr`` over the ``decay_steps`` steps after warm-up (reached at step
    ``W + decay_steps - 1``, kept after). Each group reads its own ``max_lr`` / ``min_lr`` and sets
    ``weight_decay = optim.weight_decay * wd_mult``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _NextStepScheduler(OptimizerParamScheduler):
        def get_lr(self, param_group: dict) -> float:
            self.num_steps += 1
            try:
                return super().get_lr(param_group)
            finally:
                self.num_steps -= 1

    warmup = o.warmup_steps
    decay = o.decay_steps if o.schedule != "constant" else 1  # megatron needs decay steps > warm-up steps
    return _NextStepScheduler(optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
                              lr_decay_steps=warmup + decay, lr_decay_style=o.schedule,
                              start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=warmup + decay,
                              wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
                              override_opt_param_scheduler=o.resume_schedule == "recipe")


def set_lrs(opt, scheduler, o, *, lr: Optional[float] = None, lr_scale: float = 1.0,
            critic_lr_scale: float = 1.0, report_max_lr: Optional[float] = None) -> float:
    """Each group's lr and weight decay for the coming step of ``opt``: ``scheduler`` at this step (``lr``
    None; ``opt`` must be the scheduler's), or the constant ``lr`` (the supervised warm-up's own
    optimizer), times ``lr_scale`` (the critic group's also times ``critic_lr_scale``). Returns the lr of
    the groups whose ``max_lr`` is ``report_max_lr`` (default ``optim.lr``: the policy's; a separate
    critic reports its own), ``nan`` if there is none."""
    if lr is None:
        if opt is not scheduler.optimizer:
            raise RuntimeError("optimizer_step without lr steps the run's optimizer only")
        scheduler.step(0)  # writes every group's lr (max_lr / min_lr) and weight decay (x wd_mult)
    else:
        for g in opt.param_groups:
            g["lr"] = lr * g["max_lr"] / o.lr
            g["weight_decay"] = opt.trainer_weight_decay * g["wd_mult"]
    for g in opt.param_groups:
        g["lr"] *= lr_scale * (critic_lr_scale if g.get("name") == "critic" else 1.0)
    report = o.lr if report_max_lr is None else report_max_lr
    return next((g["lr"] for g in opt.param_groups if g["max_lr"] == report), math.nan)
