"""CompPO (docs/architecture.md "CompPO"): computation-conditioned credit transport.

Everything CompPO is lives here, and the trainer names none of it:

- its capture (:class:`GateCapture`): the dynamic gate ``kappa_t`` from the final layer's attention
  concentration ``H_t``, and the top-K keys its transport-aligned critic pools, read in the behaviour pass;
- its estimator, Comp-GAE (``credit.gae.comp_gae``: ``delta_t = r_t + kappa_t V_{t+1} - V_t``,
  ``A_t = delta_t + lambda kappa_t A_{t+1}``), with the transport a gate control gives
  (``gate_controls``: the dynamic gate, a fixed one, a shuffle, a position schedule);
- its critic (``critic_kinds``: ``tac``, ``standard`` or PPO's ``trunk``), value loss and advantage clip;
- its phase controller (``algorithm.phase``), which moves the clips and the trainer's knobs between
  iterations;
- the state of the last two, saved with each checkpoint.

``comppo`` uses PPO's symmetric clip (the paper's Table 13), ``comppo_fipo`` FIPO's Future-KL weighted
DAPO loss.

>>> CompPO.Config().build().critic_kind is not None, CompFIPO.Config().tau
(True, 32.0)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from megatron_credit.algorithm.base import (ActorCritic, AdvantageInputs, AdvantageOutput, AdvantagePost, PPOClip,
                                            scaled)
from megatron_credit.algorithm.capture import CaptureOutput, FinalLayerCapture
from megatron_credit.algorithm.fipo import FIPO
from megatron_credit.algorithm.gate_controls import GATE_CONTROLS, GateControl
from megatron_credit.algorithm.knobs import StepKnobs, phase_knobs, phase_ratio
from megatron_credit.metrics.tables import CRITIC, GATES
from megatron_credit.metrics.tables import FIPO as FIPO_METRICS
from megatron_credit.credit.gae import comp_gae
from megatron_credit.algorithm.phase import PHASES, PhaseController, PhaseThresholds
from megatron_credit.typed_build import NonNegativeInt, PositiveFloat, PositiveInt, UnitFloat


class GateCapture(FinalLayerCapture):
    """CompPO's behaviour-pass capture: the dynamic gate ``kappa = gate_fn(H, n)`` (``credit.gates.comppo_gate``)
    and, for its transport-aligned critic, the ``top_k`` keys the final layer attends to most
    (``topk_idx``, global positions, and their weights ``topk_w``; ``top_k = 0``: empty)."""

    def __init__(self, gate_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, top_k: int = 0,
                 sink_keys: int = 0) -> None:
        super().__init__(top_k=top_k, sink_keys=sink_keys)
        self.gate_fn = gate_fn

    @property
    def outputs(self) -> Mapping[str, CaptureOutput]:
        return {"kappa": CaptureOutput(torch.float32), "concentration": CaptureOutput(torch.float32),
                "topk_idx": CaptureOutput(torch.long, (self.top_k,)),
                "topk_w": CaptureOutput(torch.float32, (self.top_k,))}

    @property
    def critic_inputs(self) -> tuple[str, ...]:
        return ("kappa", "topk_idx", "topk_w")  # the concentration is for the credit maps only

    def read(self, result: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {"kappa": self.gate_fn(result["H"].float(), result["n"]).float(), "concentration": result["H"].float()}
        if "topk_idx" in result:
            out["topk_idx"] = result["topk_idx"]
            out["topk_w"] = result["topk_w"].float()
        return out


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


class CompPO(PPOClip, ActorCritic):
    """CompPO: Comp-GAE advantages from the captured gate, a feature critic, PPO's symmetric clip."""

    metrics = (CRITIC, GATES)
    critics = ("tac", "standard", "trunk")

    @dataclass(frozen=True, kw_only=True)
    class Fields(ActorCritic.Config):
        """CompPO's own knobs (docs/architecture.md "CompPO"): the gate, its controls, the critic, the phase
        controller. Shared by ``comppo`` and ``comppo_fipo``."""

        lam: UnitFloat = 0.95
        """Comp-GAE lambda."""
        k_lo: UnitFloat = 0.1
        """Lower end of the gate envelope."""
        k_hi: UnitFloat = 0.9
        """Upper end of the gate envelope."""
        gate_tau: PositiveFloat = 4.0
        """Sharpness of the gate's sigmoid in the normalised concentration."""
        gate_sink_keys: NonNegativeInt = 0
        """Attention-sink keys left out of the gate's concentration ``H``: the first ``gate_sink_keys``
        positions, the distribution renormalised over the rest (0: off, the paper's gate). ``tools/gate_stats.py``
        measures how much of ``H`` they supply."""
        gate_control: str = "dynamic"
        """``dynamic`` (the gate from attention), ``fixed`` (``fixed_gate`` everywhere), ``shuffle`` (a global
        permutation of the batch's gates over valid response positions) or ``position`` (mean gate in
        ``position_bins`` bins of t/T, collected for ``position_steps`` iterations, then frozen)."""
        fixed_gate: UnitFloat = 0.61
        """The ``fixed`` control's gate (the paper's mean gate on math)."""
        position_bins: PositiveInt = 20
        """Bins of relative position t/T of the ``position`` control."""
        position_steps: PositiveInt = 10
        """Iterations whose dynamic gates build the ``position`` schedule (dynamic gates are used meanwhile)."""
        critic: str = "tac"
        """``tac`` (the transport-aligned critic), ``standard`` (a linear head on the detached final hidden
        state) or ``trunk`` (PPO's head: on the final hidden state, not detached, clipped with the policy; with
        ``gate_control: fixed`` at PPO's gamma and PPO's settings it reproduces ``ppo`` bit for bit)."""
        critic_layers: PositiveInt = 4
        """TAC: how many of the last layers' hidden states are fused (L')."""
        critic_top_k: PositiveInt = 64
        """TAC: keys of the final-layer attention pooled into the history summary."""
        critic_warmup_steps: NonNegativeInt = 0
        """Iterations the critic trains before its values enter the advantages (V = 0 until then)."""
        value_clamp: PositiveFloat = 1.0
        """The critic's output is clamped to ``[-value_clamp, value_clamp]``."""
        value_clip: Optional[PositiveFloat] = 0.5
        """Value-loss clip (None: unclipped)."""
        adv_clip: Optional[PositiveFloat] = 5.0
        """Advantages are clipped to ``[-adv_clip, adv_clip]`` (None: off)."""
        whiten_advantages: bool = False
        """Whiten advantages over the global batch."""
        phase_controller: bool = False
        """Run the stable / warning / strong / hard-stop controller (``algorithm.phase``) on each step's metrics;
        each phase scales the policy clip, ``value_clip`` and ``adv_clip`` (and the trainer's knobs)."""
        phase_thresholds: PhaseThresholds = field(
            default_factory=lambda: PhaseThresholds(entropy_below=(None, None, None)),
            metadata={"partial_override": True})
        """The controller's request thresholds: the paper's, except ``entropy_below`` (its 8.0 / 7.5 / 6.5 are
        not on the scale of ``actor/entropy``, a per-token mean in nats, usually under 2: with them every run
        ends in hard-stop), which is off unless a recipe sets levels for its own model. A recipe's mapping
        overrides only the signals it names."""

        def __post_init__(self) -> None:
            if getattr(super(), "__post_init__", None):
                super().__post_init__()
            if not 0.0 <= self.k_lo <= self.k_hi <= 1.0:
                raise ValueError(f"algorithm.params: need 0 <= k_lo <= k_hi <= 1, got k_lo={self.k_lo}, k_hi={self.k_hi}")
            if self.gate_control not in GATE_CONTROLS:
                raise ValueError(f"algorithm.params.gate_control={self.gate_control!r}: valid values {list(GATE_CONTROLS)}")

        def gate_control_settings(self) -> tuple[str, dict]:
            """The gate control's name in ``gate_controls.GATE_CONTROLS`` and its keywords."""
            return self.gate_control, {"fixed_gate": self.fixed_gate, "position_bins": self.position_bins,
                                       "position_steps": self.position_steps}

    @dataclass(frozen=True, kw_only=True)
    class Config(Fields, PPOClip.Config):
        """CompPO: Comp-GAE advantages, PPO's symmetric clip (the paper's Table 13)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.gate_control: Optional[GateControl] = None
        self.phase = None if not config.phase_controller else PhaseController(config.phase_thresholds)

    # --- the forward pass and the advantages ------------------------------------------------------------
    def capture(self, *, top_k: int = 0) -> GateCapture:
        """The dynamic gate ``kappa`` of docs/architecture.md "CompPO" from the final layer's attention concentration,
        and ``top_k`` keys for the transport-aligned critic."""
        from megatron_credit.credit.gates import comppo_gate

        c = self.config
        return GateCapture(functools.partial(comppo_gate, k_lo=c.k_lo, k_hi=c.k_hi, tau=c.gate_tau),
                           top_k=top_k, sink_keys=c.gate_sink_keys)

    def advantage_inputs(self, side, mask, iteration):
        """Comp-GAE's transport ``gates`` from the captured ``kappa`` (the dynamic gate, or the gate
        control's, for ``iteration``) and the gate statistics."""
        gates = self.gate_control.gates(side["kappa"], mask, iteration=iteration)
        return {"gates": gates}, gate_stats(side["kappa"], mask, gates)

    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        inputs.require("token_rewards", "values", "gates")
        adv, ret = comp_gae(inputs.token_rewards, inputs.values, inputs.extras["gates"], inputs.response_mask,
                            obs_mask=inputs.obs_mask,
                            lam=self.config.lam, cp_group=cp_group)
        return AdvantageOutput(advantages=adv, returns=ret)

    def credit_fields(self, *, logp, old_logp, advantages, mask, side):
        """The dynamic gate ``kappa_t``, the final layer's concentration ``H_t`` it comes from, and the
        transport Comp-GAE used (``gates``: ``kappa_t``, or a gate control's)."""
        out = {"kappa": side["kappa"], "H": side["concentration"]}
        if "gates" in side:
            out["transport"] = side["gates"]
        return out

    @property
    def advantage_post(self) -> AdvantagePost:
        c = self.config
        return AdvantagePost(critic_warmup_steps=c.critic_warmup_steps, whiten=c.whiten_advantages, clip=c.adv_clip)

    # --- state across iterations: the gate control and the phase controller ---------------------------------
    def start(self, *, seed: int, dp_rank: int, dp_group: Any = None, device: Any = None) -> None:
        """The gate control the config names, seeded by the run's ``seed`` and this ``dp_rank``; its
        collectives over ``dp_group`` on ``device``."""
        self.gate_control = GateControl(self.recipe_config, seed=seed, dp_rank=dp_rank, dp_group=dp_group,
                                        device=device)

    def knobs(self, base: StepKnobs) -> StepKnobs:
        """The phase's knobs (``knobs.phase_knobs``), when the phase controller runs."""
        return base if self.phase is None else phase_knobs(base, self.phase.phase)

    def after_iteration(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """Feed the metrics to the phase controller; the next iteration's clips follow its phase. Logs
        ``phase/level`` (0 stable ... 3 hard-stop)."""
        if self.phase is None:
            return {}
        level = float(PHASES.index(self.phase.step(metrics)))
        self._follow_phase()
        return {"phase/level": level}

    def _follow_phase(self) -> None:
        """The config in force: the recipe's clips scaled by the phase's ratios to the stable row."""
        p = self.phase.phase
        self.config = scaled(self.recipe_config, clip_eps=phase_ratio(p, "clip"), clip_low=phase_ratio(p, "clip"),
                             clip_high=phase_ratio(p, "clip"), value_clip=phase_ratio(p, "value_clip"),
                             adv_clip=phase_ratio(p, "adv_clip"))

    def state_dict(self) -> dict:
        out = {"gate_control": self.gate_control.state_dict()}
        if self.phase is not None:
            out["phase"] = self.phase.state_dict()
        return out

    def load_state_dict(self, state: Optional[Mapping]) -> None:
        state = state or {}
        if "gate_control" in state:
            self.gate_control.load_state_dict(state["gate_control"])
        if self.phase is not None and "phase" in state:
            self.phase.load_state_dict(state["phase"])
            self._follow_phase()


class CompFIPO(CompPO):
    """``comppo_fipo``: Comp-GAE advantages inside FIPO's Future-KL weighted DAPO loss."""

    metrics = (FIPO_METRICS, CRITIC, GATES)

    @dataclass(frozen=True, kw_only=True)
    class Config(CompPO.Fields, FIPO.Config):
        """``comppo_fipo``: Comp-GAE advantages inside FIPO's Future-KL weighted DAPO loss."""

    loss = FIPO.loss

    def credit_fields(self, *, logp, old_logp, advantages, mask, side):
        """CompPO's gate and FIPO's weights on Comp-GAE's advantages."""
        kw = dict(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, side=side)
        return {**CompPO.credit_fields(self, **kw), **FIPO.credit_fields(self, **kw)}
