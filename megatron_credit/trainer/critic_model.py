"""PPO's critic as a model of its own (``algorithm.params.critic: separate``), as verl and OpenRLHF build it.

The value model is a :class:`~megatron_credit.trainer.actor.Actor` with ``role="critic"``: this rank's
pipeline stage of a ``GPTModel`` of the actor's architecture, in the actor's TP / PP / CP / DP layout (the
same process groups, so its micro-batches are the update's), with the default zero-initialised value
head on the last stage. It differs from the policy in four ways:

- its word embeddings are untied from an output layer that is frozen and never called (values are read
  from the final hidden states; with tied embeddings a frozen output copy would be summed across pipeline
  stages with a trainable embedding);
- it starts from the actor's weights at the start of RL (after the supervised warm-up, when there is
  one), copied rank by rank: no second read of the checkpoint;
- every parameter is on the critic's schedule (``optim.critic_lr``, the policy's shape), with its own
  gradient clip, and the critic lr scale of the step's knobs;
- it is saved next to the policy in each checkpoint (``critic_optim/``, reshardable like ``model_optim/``).

The update then runs two forward-backward schedules per mini-batch: the policy's (policy loss, no value
loss) and the critic's (the clipped value loss), each followed by its own optimizer step.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch


def wants_separate_critic(algorithm) -> bool:
    """Whether the algorithm (``algorithm.base.Algorithm``) trains a value model of its own (PPO with
    ``algorithm.params.critic: separate``)."""
    kind = algorithm.critic_kind
    return kind is not None and kind.separate_model


def build_separate_critic(hf_config, algorithm, *, device: torch.device, **settings):
    """The separate value model of this rank on ``device``, or None when the algorithm has none (call
    after ``distributed.initialize``, next to the actor). ``settings``: the actor's recipe sections and
    values (``trainer.loop.actor_settings``: ``model``, ``parallel``, ``optim``, ``seed``, ...)."""
    if not wants_separate_critic(algorithm):
        return None
    from megatron_credit.trainer.actor import Actor

    untied = copy.deepcopy(hf_config)
    untied.tie_word_embeddings = False
    return Actor(hf_config=untied, device=device, with_critic=True, with_reference=False, role="critic", **settings)


@torch.no_grad()
def init_critic_from(critic, actor) -> None:
    """The critic's trunk := the actor's current weights (same layout, same ranks); its value head stays
    zero and its unused output layer is zeroed (built uninitialised when the actor loads a checkpoint,
    it would otherwise be saved as whatever memory held). Then the optimizer's fp32 copies follow."""
    actor.gather_params()
    src = actor.model.state_dict()
    copied = 0
    for name, tensor in critic.model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        if name.startswith("output_layer."):
            tensor.zero_()
            continue
        if name.startswith("value_head."):
            continue
        if name not in src:
            raise KeyError(f"separate critic: the actor has no {name!r} to start from")
        tensor.copy_(src[name])
        copied += 1
    assert copied > 0, "no critic weight was initialised from the actor"
    critic.sync_optimizer_from_model()


def critic_step(ctx, microbatches, stats, loss_fn) -> Optional[torch.Tensor]:
    """One forward-backward of the separate critic over ``microbatches`` with ``loss_fn`` (the value loss),
    then its optimizer step with its own clip; adds its stats to ``stats`` and returns its grad norm."""
    from megatron_credit.metrics.sums import StatSums

    critic, knobs = ctx.critic, ctx.knobs
    out = critic.run(microbatches, loss_fn, forward_only=False)
    local = StatSums()
    for s in out:
        local.add(s)
    ok = ctx.all_finite(local.get("sum:value_loss"))
    clip = knobs.clip_grad if knobs.critic_clip_grad is None else knobs.critic_clip_grad
    norm, applied = critic.optimizer_step(lr_scale=knobs.lr_scale, loss_finite=ok, clip=clip,
                                          critic_lr_scale=knobs.critic_lr_scale)
    stats.merge(local)
    stats.add({"sum:critic_grad_norm": norm.float(),
               "sum:critic_skipped_steps": torch.tensor(0.0 if applied else 1.0)}, replicated=True)
    return norm
