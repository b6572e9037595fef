"""What may change between iterations: the step's knobs (moved by CompPO's phase controller) and the
transport gates of Comp-GAE (the dynamic gate or one of its controls). No megatron import.

The recipe and the algorithm's parameters are never mutated: each iteration reads a :class:`StepKnobs`,
rebuilt from them (and from the phase, when the controller runs) with ``dataclasses.replace``.

Phase settings are applied *relative to the stable row* of the paper's Table 14: a recipe whose stable
settings are the paper's (clip 0.2, lr 1e-6, KL 2e-3, ...) gets the paper's numbers in every phase, and a
recipe with other base settings (the CPU demo's lr 2e-4) gets the same proportional moves.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_credit.algorithm.gate_controls import GateControl  # noqa: F401  (re-exported: the trainer's type of ctx.gate_control)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepKnobs:
    """The settings one iteration runs with."""

    params: Any
    """The algorithm's parameter dataclass in force (clip ranges, value clip, advantage clip)."""
    kl_coef: float
    """Weight of the KL penalty to the reference policy."""
    lr_scale: float = 1.0
    """Multiplies the scheduled actor learning rate."""
    critic_lr_scale: float = 1.0
    """Multiplies the critic's learning rate (on top of ``lr_scale``)."""
    clip_grad: float = 1.0
    """Gradient-norm clip of the policy (and of a PPO trunk head)."""
    critic_clip_grad: Optional[float] = None
    """Gradient-norm clip of a detached critic (None: ``clip_grad``)."""
    epochs: int = 1
    """Passes over the iteration's mini-batches."""
    phase: str = "stable"
    """CompPO's phase (``stable`` when the controller is off)."""


def base_knobs(params, *, kl_coef: float, clip_grad: float, epochs: int) -> StepKnobs:
    """The recipe's own settings (``algorithm.kl_coef``, ``optim.clip_grad``, ``train.epochs``, given by
    ``trainer.loop.build``)."""
    return StepKnobs(params=params, kl_coef=kl_coef, clip_grad=clip_grad, epochs=epochs)


def phase_knobs(base: StepKnobs, phase: str) -> StepKnobs:
    """The knobs of ``phase``: every setting of the phase table scaled by its ratio to the stable row,
    from ``base`` (the recipe's own: :func:`base_knobs`)."""
    from megatron_credit.credit.phase import PHASE_TABLE

    s, stable = PHASE_TABLE[phase], PHASE_TABLE["stable"]
    ratio = lambda field: getattr(s, field) / getattr(stable, field)  # noqa: E731
    moved = base.params.scaled_for_phase(clip=ratio("clip"), value_clip=ratio("value_clip"),
                                         adv_clip=ratio("adv_clip"))
    return StepKnobs(params=moved, kl_coef=base.kl_coef * ratio("kl_coef"),
                     lr_scale=ratio("actor_lr"), critic_lr_scale=s.critic_lr_mult / stable.critic_lr_mult,
                     clip_grad=base.clip_grad * ratio("grad_clip"), critic_clip_grad=base.clip_grad * ratio("grad_clip"),
                     epochs=max(1, round(base.epochs * ratio("epochs"))), phase=phase)


def gate_stats(kappa: torch.Tensor, mask: torch.Tensor, transport=None) -> dict[str, torch.Tensor]:
    """Sums for ``comppo/gate_mean`` and the mean dynamic gate in the first / middle / last third of each
    response (by relative position; the paper reports 0.61 and 0.52 / 0.63 / 0.68 on math), and for
    ``comppo/transport_mean``, the mean of the gates the advantages used (``transport``)."""
    m = mask.bool()
    pos = torch.cumsum(m.long(), dim=1) - 1  # index of the token within its response
    length = m.sum(dim=1, keepdim=True).clamp(min=1)
    third = torch.div(3 * pos, length, rounding_mode="floor").clamp(max=2)
    out = {"sum:gate": torch.where(m, kappa, 0.0).sum(), "sum:gate_tokens": m.sum().float()}
    if transport is not None:  # the gate Comp-GAE actually used (a control's, or kappa itself)
        out["sum:transport"] = torch.where(m, transport, 0.0).sum()
    for i, name in enumerate(("first", "mid", "last")):
        sel = m & (third == i)
        out[f"sum:gate_{name}"] = torch.where(sel, kappa, 0.0).sum()
        out[f"sum:gate_{name}_tokens"] = sel.sum().float()
    return out


def actor_options(spec, params, hf_config, *, dtype, pp_size: int = 1) -> dict:
    """The :class:`~megatron_credit.trainer.actor.Actor` keywords an algorithm needs: ``with_critic`` (a
    value head on the actor: critic algorithms, unless the critic is a separate model,
    ``trainer.critic_model``), the behaviour pass's capture and gate map (``spec.gate_options``) and the
    critic kind's own keywords (``critic_kinds``: a critic on the actor's detached features)."""
    kind = spec.critic_kind(params)
    out = {"with_critic": kind is not None and not kind.separate_model, **spec.gate_options(params)}
    if kind is not None and kind.actor_options is not None:
        out.update(kind.actor_options(params, hf_config, dtype=dtype, pp_size=pp_size))
    return out
