"""The optimizer of an :class:`~megatron_credit.trainer.actor.Actor`'s model for either ``optim.backend``: which
parameters go in which group, and the group keys megatron's ``OptimizerParamScheduler`` reads
(``max_lr`` / ``min_lr`` / ``wd_mult``; ``trainer/schedule.py`` writes the rates each step).

- No weight decay on biases and norms (1-D parameters).
- The value head of a trunk critic (PPO's, a feature critic's) in a group of its own, on the policy's schedule
  scaled by ``optim.critic_lr / optim.lr``; a separate critic (``role="critic"``) has every group on that
  schedule.
- Frozen parameters (a separate critic's output layer) are left out.

A megatron adapter by design: ``optim.backend: megatron`` is megatron's ``get_megatron_optimizer``, so this
file imports megatron (lazily, for that backend only); only ``actor.py`` calls it.
"""
from __future__ import annotations

import torch

from megatron_credit.trainer.schedule import critic_schedule


def build_optimizer(actor, *, weight_decay: float):
    """AdamW on fp32 masters (``trainer.optimizer``), or megatron's optimizer (``optim.backend: megatron``)."""
    from megatron_credit.trainer.optimizer import MasterWeightsAdamW

    o, wd = actor.optim, weight_decay
    if actor.megatron_optimizer:
        return _megatron_optimizer(actor, weight_decay=wd)
    decay, no_decay, critic = [], [], []
    for name, p in actor.model.named_parameters():
        if not p.requires_grad:
            continue
        (critic if name.startswith("value_head.") else no_decay if p.dim() < 2 else decay).append(p)
    # megatron's group keys, read by OptimizerParamScheduler: max_lr / min_lr (the value head's schedule
    # is the policy's scaled by critic_lr / lr) and wd_mult (weight_decay = the run's decay x wd_mult).
    policy, head = {"max_lr": o.lr, "min_lr": o.min_lr}, critic_schedule(o)
    if actor.is_critic:  # a separate value model: all of it on the critic's schedule (and its lr scale)
        policy = {**head, "name": "critic"}
    groups = [{"params": decay, "weight_decay": wd, "wd_mult": 1.0, **policy},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, **policy},
              {"params": critic, "weight_decay": 0.0, "wd_mult": 0.0, **head, "name": "critic"}]
    opt = MasterWeightsAdamW([g for g in groups if g["params"]], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    opt.trainer_weight_decay = wd
    return opt


def _megatron_optimizer(actor, *, weight_decay: float):
    """``get_megatron_optimizer`` over the DDP-wrapped model: Adam with decoupled weight decay, megatron's
    standard groups (no decay on biases and 1-D parameters) plus the value head's (``critic_lr``,
    no decay). Gradient clipping is done in ``Actor.optimizer_step``'s order (norm, finiteness check,
    clip, step), with megatron's own norm and clip."""
    from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
    from megatron.core.optimizer import get_standard_config_overrides

    o, dtype = actor.optim, actor.config.params_dtype
    if dtype == torch.float16:
        raise ValueError("optim.backend: megatron with model.params_dtype float16 needs loss scaling, which the "
                         "trainer does not do: use bfloat16 or float32")
    peak = critic_schedule(o) if actor.is_critic else {"max_lr": o.lr, "min_lr": o.min_lr}
    lr, min_lr = peak["max_lr"], peak["min_lr"]
    cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                          adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
                          bf16=dtype == torch.bfloat16, params_dtype=dtype,
                          use_distributed_optimizer=o.distributed_optimizer,
                          overlap_param_gather=o.overlap_param_gather)
    overrides = get_standard_config_overrides(cfg)
    # The value head: no decay, its own max_lr / min_lr (what the scheduler reads). megatron matches the
    # groups of a checkpoint by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) only
    # (``param_group_identifier_keys``), so the head's group carries lr_mult = critic_lr / lr (read by
    # nothing else in 0.16.1) to stay apart from the no-decay group, or is that group (critic_lr == lr).
    head = ({"wd_mult": 0.0} if o.critic_lr == o.lr or actor.is_critic
            else {"wd_mult": 0.0, "lr_mult": o.critic_lr / o.lr, **critic_schedule(o)})
    overrides[ParamKey(name="*value_head.*")] = head
    opt = get_megatron_optimizer(cfg, [actor.ddp], config_overrides=overrides)
    opt.trainer_weight_decay = weight_decay
    return opt
