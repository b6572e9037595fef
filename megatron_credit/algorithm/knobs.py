"""What may change between iterations: the trainer's knobs (moved by CompPO's phase controller,
``algorithm/comppo.py``, which also scales its own clips by :func:`phase_ratio`). No megatron import.

The recipe is never mutated: each iteration reads a :class:`StepKnobs`, rebuilt from the recipe's own
(and from the phase, when the controller runs).

Phase settings are applied *relative to the stable row* of the paper's Table 14: a recipe whose stable
settings are the paper's (clip 0.2, lr 1e-6, KL 2e-3, ...) gets the paper's numbers in every phase, and a
recipe with other base settings (the CPU demo's lr 2e-4) gets the same proportional moves.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepKnobs:
    """The settings one iteration runs with."""

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


def base_knobs(*, kl_coef: float, clip_grad: float, epochs: int) -> StepKnobs:
    """The recipe's own settings (``algorithm.kl_coef``, ``optim.clip_grad``, ``train.epochs``, given by
    ``trainer.loop.build``)."""
    return StepKnobs(kl_coef=kl_coef, clip_grad=clip_grad, epochs=epochs)


def phase_ratio(phase: str, setting: str) -> float:
    """A setting of the phase table (``algorithm.phase.PHASE_TABLE``: ``clip``, ``kl_coef``, ...) in ``phase``,
    relative to the stable row."""
    from megatron_credit.algorithm.phase import PHASE_TABLE

    return getattr(PHASE_TABLE[phase], setting) / getattr(PHASE_TABLE["stable"], setting)


def phase_knobs(base: StepKnobs, phase: str) -> StepKnobs:
    """The trainer's knobs in ``phase``: every setting of the phase table scaled by its ratio to the stable
    row, from ``base`` (the recipe's own: :func:`base_knobs`). The algorithm's clips are its own
    (``CompPO``)."""
    from megatron_credit.algorithm.phase import PHASE_TABLE

    s, stable = PHASE_TABLE[phase], PHASE_TABLE["stable"]
    ratio = functools.partial(phase_ratio, phase)
    return StepKnobs(kl_coef=base.kl_coef * ratio("kl_coef"),
                     lr_scale=ratio("actor_lr"), critic_lr_scale=s.critic_lr_mult / stable.critic_lr_mult,
                     clip_grad=base.clip_grad * ratio("grad_clip"), critic_clip_grad=base.clip_grad * ratio("grad_clip"),
                     epochs=max(1, round(base.epochs * ratio("epochs"))), phase=phase)
