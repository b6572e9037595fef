"""The actor's optimizer step: the global gradient norm (megatron's counting over TP and PP), the clip
(the policy and a feature critic apart), the skip of a non-finite step, and the update by either backend
(``optim.backend``: our AdamW on fp32 masters, or megatron's optimizer with its own norm and clip).

:class:`OptimizerStep` is a mixin of :class:`megatron_credit.trainer.actor.Actor`, which builds what it
reads: ``model``, ``ddp``, ``optimizer``, ``scheduler``, ``optim``, ``device``, ``feature_critic``, the TP /
PP groups, sizes and ranks, and the lr bookkeeping (``last_lr``, ``_report_max_lr``,
``last_critic_grad_norm``, ``optimizer_steps``). One job here, building and running the model there.
"""
from __future__ import annotations

import math

from typing import Optional

import torch
import torch.distributed as dist

from megatron_credit.distributed.grads import grad_of
from megatron_credit.trainer.optimizer import MasterWeightsAdamW
from megatron_credit.trainer.schedule import set_lrs


class OptimizerStep:
    """Reduce, measure, clip and apply an actor's gradients (see the module docstring)."""

    def global_grad_norm(self, params=None) -> torch.Tensor:
        """L2 norm of the gradient of ``params`` (default: the whole model), the same on every rank (float64).

        Megatron's counting: TP-sharded parameters add their shard on every TP rank; parameters
        replicated over TP are counted on TP rank 0 only; the last stage's copy of a tied embedding
        (``shared``) is not counted; routed experts (megatron's ``allreduce=False``) are summed over EP first;
        stages are summed over PP."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters() if params is None else params:
            g = grad_of(p)
            if g is None or getattr(p, "shared", False):
                continue
            if not getattr(p, "tensor_model_parallel", False) and self.tp_rank != 0:
                continue
            if getattr(p, "allreduce", True):
                sq += g.detach().double().pow(2).sum()
            else:
                expert_sq += g.detach().double().pow(2).sum()
        ep_size = getattr(self, "ep_size", 1)
        if ep_size > 1:
            dist.all_reduce(expert_sq, group=self.ep_group)
        sq = sq + expert_sq
        for group, size in ((self.tp_group, self.tp_size), (self.pp_group, self.pp_size)):
            if size > 1:
                dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def _param_sets(self) -> list[list[torch.nn.Parameter]]:
        """Parameter sets clipped separately: the whole model, or (feature critic) policy and critic."""
        if not self.feature_critic:
            return [list(self.model.parameters())]
        policy, critic = [], []
        for name, p in self.model.named_parameters():
            (critic if name.startswith("value_head.") else policy).append(p)
        return [policy, critic]  # the critic set is empty off the last stage; the norms still all-reduce

    def optimizer_step(self, *, lr: Optional[float] = None, lr_scale: float = 1.0, loss_finite: bool = True,
                       clip: Optional[float] = None, critic_clip: Optional[float] = None,
                       critic_lr_scale: float = 1.0) -> tuple[torch.Tensor, bool]:
        """Reduce gradients, clip, step; returns ``(grad_norm, applied)``.

        The learning rates are the schedule's (``trainer/schedule.py``) at this step, times ``lr_scale``
        (the critic's also times ``critic_lr_scale``); ``lr`` instead sets a constant one (the warm-up).
        ``clip`` (default ``optim.clip_grad``) bounds the gradient norm; a feature critic (on the actor's detached features,
        detached from the policy) is clipped on its own to ``critic_clip`` (default ``clip``) and its norm
        kept in ``last_critic_grad_norm``; the returned norm is then the policy's. A step whose gradient
        norm (or loss) is not finite is skipped: gradients are dropped, the parameters, the optimizer state
        and the schedule's position are untouched."""
        from megatron_credit.distributed.grads import finalize

        finalize(self.ddp)  # DP x CP sum, TP norms, tied embeddings (no num_tokens: already global shares)
        if not isinstance(self.optimizer, MasterWeightsAdamW):
            if critic_lr_scale != 1.0:  # a critic lr knob of the algorithm's state: refused with this backend
                raise ValueError("optim.backend: megatron has no separate critic learning rate to scale")
            policy_lr = set_lrs(self.optimizer, self.scheduler, self.optim, lr=lr, lr_scale=lr_scale,
                                report_max_lr=self._report_max_lr)
            norm, ok = self._megatron_step(loss_finite=loss_finite, clip=clip)
            if ok and lr is None:
                self.last_lr = policy_lr
            return norm, ok
        clip = self.optim.clip_grad if clip is None else clip
        sets = self._param_sets()
        clips = [clip, clip if critic_clip is None else critic_clip][: len(sets)]
        norms = [self.global_grad_norm(ps_) for ps_ in sets]
        self.last_critic_grad_norm = norms[1] if len(norms) > 1 else None
        # one read of the device for the step: were the norms finite (the clip below stays on the device)
        ok = loss_finite and bool(torch.stack([torch.isfinite(n) for n in norms]).all())
        if ok:
            for params, norm, c in zip(sets, norms, clips):
                if c > 0:  # c / (norm + 1e-6) where the norm exceeds c, else 1 (the grads as they are)
                    norm = norm.to(torch.float64)
                    coef = torch.where(norm > c, c / (norm + 1e-6), torch.ones_like(norm))
                    for p in params:
                        if grad_of(p) is not None:
                            grad_of(p).mul_(coef.to(grad_of(p).device))
            policy_lr = set_lrs(self.optimizer, self.scheduler, self.optim, lr=lr, lr_scale=lr_scale,
                                critic_lr_scale=critic_lr_scale, report_max_lr=self._report_max_lr)
            self.optimizer.step()
            if lr is None:  # the run's schedule (not the warm-up's constant lr)
                self.last_lr = policy_lr
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()
        return norms[0], ok

    def _megatron_step(self, *, loss_finite: bool, clip: Optional[float]) -> tuple[torch.Tensor, bool]:
        """megatron's ``ChainedOptimizer.step`` with the trainer's checks in between: main grads prepared,
        megatron's global norm (over DP x CP shards with the distributed optimizer, TP and PP), the step
        skipped when the loss or the norm is not finite, then the clip and the update."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt, o = self.optimizer, self.optim
        clip = o.clip_grad if clip is None else clip
        found_inf = opt.prepare_grads()
        total = float(opt.get_grad_norm())  # megatron's norm is a host float already
        norm = torch.tensor(total, dtype=torch.float64).to(self.device)
        ok = loss_finite and not found_inf and math.isfinite(total)
        if ok:
            if clip > 0:
                for inner in opt.chained_optimizers:
                    params = inner.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=total)
            ok = bool(opt.step_with_ready_grads())
            self.optimizer_steps += int(ok)
        opt.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()
        return norm, ok

    # -- weights in ------------------------------------------------------------------------------------
