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


def base_knobs(recipe, params) -> StepKnobs:
    """The recipe's own settings."""
    return StepKnobs(params=params, kl_coef=recipe.algorithm.kl_coef, clip_grad=recipe.optim.clip_grad,
                     epochs=recipe.train.epochs)


def phase_knobs(recipe, params, phase: str) -> StepKnobs:
    """The knobs of ``phase``: every setting of the phase table scaled by its ratio to the stable row."""
    from megatron_credit.credit.phase import PHASE_TABLE

    s, base = PHASE_TABLE[phase], PHASE_TABLE["stable"]
    ratio = lambda field: getattr(s, field) / getattr(base, field)  # noqa: E731
    moved = params.scaled_for_phase(clip=ratio("clip"), value_clip=ratio("value_clip"), adv_clip=ratio("adv_clip"))
    b = base_knobs(recipe, params)
    return StepKnobs(params=moved, kl_coef=b.kl_coef * ratio("kl_coef"),
                     lr_scale=ratio("actor_lr"), critic_lr_scale=s.critic_lr_mult / base.critic_lr_mult,
                     clip_grad=b.clip_grad * ratio("grad_clip"), critic_clip_grad=b.clip_grad * ratio("grad_clip"),
                     epochs=max(1, round(b.epochs * ratio("epochs"))), phase=phase)


class GateControl:
    """Comp-GAE's transport from the behaviour pass's dynamic gate ``kappa`` (``params.gate_control``):

    - ``dynamic``: ``kappa`` itself;
    - ``fixed``: ``params.fixed_gate`` on every response token;
    - ``shuffle``: one permutation of this rank's batch's gates over its valid positions (seeded by the
      run's seed, the iteration and the DP rank), which keeps their distribution and breaks their
      placement;
    - ``position``: ``kappa`` while the mean gate per bin of relative position is collected (over DP) for
      ``params.position_steps`` iterations, then that frozen schedule.
    The critic keeps reading the dynamic ``kappa`` under every control: the controls change the credit
    transport, not the critic's features, so the gate x critic factorial varies one thing at a time.
    """

    def __init__(self, params, *, seed: int, dp_rank: int, dp_group=None):
        from megatron_credit.credit.gates import PositionGateSchedule

        self.params, self.seed, self.dp_rank, self.dp_group = params, seed, dp_rank, dp_group
        self.schedule = PositionGateSchedule(params.position_bins) if params.gate_control == "position" else None
        self.collected = 0

    def gates(self, kappa: torch.Tensor, mask: torch.Tensor, *, iteration: int) -> torch.Tensor:
        """``[B, T]`` transport gates for ``kappa, mask: [B, T]``."""
        from megatron_credit.credit import gates as g

        control = self.params.gate_control
        if control == "fixed":
            return g.fixed_gates(mask, self.params.fixed_gate)
        if control == "shuffle":
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + iteration) * 4099 + self.dp_rank)
            return g.shuffle_gates(kappa, mask, generator=gen)
        if control == "position":
            if not self.schedule.frozen:
                self.schedule.collect(kappa, mask, group=self.dp_group)
                self.collected += 1
                if self.collected >= self.params.position_steps:
                    self.schedule.freeze()
                return torch.where(mask.bool(), kappa, 0.0)
            return self.schedule.gates(mask)
        return torch.where(mask.bool(), kappa, 0.0)

    def state_dict(self) -> dict:
        return {"collected": self.collected,
                "schedule": self.schedule.state_dict() if self.schedule is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.collected = state["collected"]
        if self.schedule is not None and state["schedule"] is not None:
            self.schedule.load_state_dict(state["schedule"])


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
    ``trainer.critic_model``), and for gated algorithms (CompPO) the attention capture, the gate map and
    the chosen critic. The TAC fuses at most the layers of the last pipeline stage (the critic lives there)."""
    from megatron_credit.trainer.critic_model import wants_separate_critic

    head = {"with_critic": spec.needs_critic and not wants_separate_critic(spec, params)}
    if not spec.needs_gates:
        return head
    import functools

    from megatron_credit.credit.gates import comppo_gate

    gate_fn = functools.partial(comppo_gate, k_lo=params.k_lo, k_hi=params.k_hi, tau=params.gate_tau)
    head["capture_sink_keys"] = params.gate_sink_keys
    if params.critic == "trunk":  # PPO's value head on the actor trunk (the Actor's default head)
        return {**head, "capture_top_k": 0, "gate_fn": gate_fn}
    from megatron_credit.models.critic import StandardCritic, TransportAlignedCritic

    tac = params.critic == "tac"
    layers = min(params.critic_layers, hf_config.num_hidden_layers // pp_size) if tac else 1
    if tac:
        factory = functools.partial(TransportAlignedCritic, hf_config.hidden_size, num_layers=layers,
                                    value_clamp=params.value_clamp, dtype=dtype)
    else:
        factory = functools.partial(StandardCritic, hf_config.hidden_size, value_clamp=params.value_clamp)
    return {**head, "critic_factory": factory, "critic_layers": layers,
            "capture_top_k": params.critic_top_k if tac else 0,
            "gate_fn": gate_fn}
