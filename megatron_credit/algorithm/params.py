"""The typed parameters of each algorithm: one keyword-only dataclass per algorithm (``algorithm.params``).

``estimator_kwargs`` / ``loss_kwargs`` say which fields go to which function, so a recipe's
``algorithm.params`` reaches the math in one hop; the other hooks of :class:`AlgorithmParams` say what an
algorithm adds to an iteration (advantage post-processing, the critic it trains, how the phase
controller scales its clips), so the trainer never reads a field of an algorithm's parameters by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_credit.credit.future_kl import FIPO_DUAL_CLIP_C, FIPO_TAU, FIPO_WEIGHT_CLIP
from megatron_credit.credit.phase import PhaseThresholds
from megatron_credit.algorithm.critic_kinds import check_critic
from megatron_credit.algorithm.gate_controls import GATE_CONTROLS


@dataclass(frozen=True, kw_only=True)
class AdvantagePost:
    """What happens to the estimator's advantages before the update (``trainer/step.compute_advantages``)."""

    critic_warmup_steps: int = 0
    """Iterations whose advantages use V = 0 (the critic trains on their returns but is not trusted yet)."""
    whiten: bool = False
    """Whiten over the global batch (masked, summed over DP)."""
    clip: Optional[float] = None
    """Clip to ``[-clip, clip]`` (None: off)."""


_CLIP_FIELDS = ("clip_eps", "clip_low", "clip_high")


@dataclass(frozen=True, kw_only=True)
class AlgorithmParams:
    """The base of every algorithm's parameters: the hooks the trainer calls, with their defaults (no
    keywords for the estimator or the loss, no post-processing, a value head on the trunk when the
    algorithm has a critic). A new algorithm overrides those it needs."""

    def estimator_kwargs(self) -> dict:
        return {}

    def loss_kwargs(self) -> dict:
        return {}

    def advantage_post(self) -> AdvantagePost:
        return AdvantagePost()

    def critic_name(self) -> Optional[str]:
        """The critic kind (a name in ``algorithms.CRITIC_KINDS``) of a critic algorithm; None: ``trunk``."""
        return None

    def phase_control(self) -> Optional[PhaseThresholds]:
        """The thresholds of the phase controller (``credit.phase``) when this algorithm runs one between
        iterations; None: no controller."""
        return None

    def scaled_for_phase(self, *, clip: float, value_clip: float, adv_clip: float):
        """These parameters with the clip ranges (``clip_eps``, ``clip_low``, ``clip_high``), ``value_clip``
        and ``adv_clip``, where this algorithm has them (and they are set), multiplied by the ratios of a
        phase of CompPO's controller (``algorithm/knobs.phase_knobs``)."""
        names = {f.name for f in dataclasses.fields(self)}
        changes = {f: getattr(self, f) * clip for f in _CLIP_FIELDS if f in names}
        for name, ratio in (("value_clip", value_clip), ("adv_clip", adv_clip)):
            if name in names and getattr(self, name) is not None:
                changes[name] = getattr(self, name) * ratio
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class ClipParams(AlgorithmParams):
    """Dr.GRPO / RLOO (and GRPO's base): symmetric PPO clip. No ``norm_by_std``: these estimators never
    divide by the group's standard deviation, so a recipe that sets it is refused (unknown field)."""

    clip_eps: float = 0.2
    """Clip range ``[1 - eps, 1 + eps]``."""

    def estimator_kwargs(self) -> dict:
        return {}

    def loss_kwargs(self) -> dict:
        return {"clip_eps": self.clip_eps}


@dataclass(frozen=True, kw_only=True)
class GRPOParams(ClipParams):
    """GRPO."""

    norm_by_std: bool = True
    """Divide the group-centred score by the group's standard deviation."""

    def estimator_kwargs(self) -> dict:
        return {"norm_by_std": self.norm_by_std}


@dataclass(frozen=True, kw_only=True)
class DAPOParams(AlgorithmParams):
    """DAPO: clip-higher and dual clip."""

    clip_low: float = 0.2
    """eps_low."""
    clip_high: float = 0.28
    """eps_high (clip-higher)."""
    dual_clip_c: Optional[float] = 3.0
    """Dual-clip constant for A < 0 (None: off)."""

    def estimator_kwargs(self) -> dict:
        return {}

    def loss_kwargs(self) -> dict:
        return {"clip_low": self.clip_low, "clip_high": self.clip_high, "dual_clip_c": self.dual_clip_c}


@dataclass(frozen=True, kw_only=True)
class GSPOParams(AlgorithmParams):
    """GSPO: sequence-ratio clip (its ranges are ~1e-4)."""

    clip_low: float = 3e-4
    """eps_low of the sequence ratio."""
    clip_high: float = 4e-4
    """eps_high of the sequence ratio."""

    def estimator_kwargs(self) -> dict:
        return {}

    def loss_kwargs(self) -> dict:
        return {"clip_low": self.clip_low, "clip_high": self.clip_high}


@dataclass(frozen=True, kw_only=True)
class FIPOParams(DAPOParams):
    """FIPO = DAPO on ``f_t * A_t`` with Future-KL weights (DESIGN.md "FIPO")."""

    dual_clip_c: float = FIPO_DUAL_CLIP_C
    """Dual-clip constant ``c``; also the participation threshold of ``M_k`` (10 for 32B, 3 for 7B)."""
    tau: float = FIPO_TAU
    """Half-life of the future discount: ``gamma = 2^(-1/tau)``."""
    weight_clip: tuple = FIPO_WEIGHT_CLIP
    """``[lo, hi]`` clip of ``exp(F_t)``."""
    safety_thresh: Optional[float] = None
    """Ratio above which ``f = min(f, 1)`` for A < 0 (None: ``dual_clip_c``)."""
    drop_multi_dual_clip: bool = False
    """Drop responses with more than one dual-clipped token (the published code; off by default)."""

    def __post_init__(self) -> None:
        w = tuple(float(x) for x in self.weight_clip)
        if len(w) != 2:
            raise ValueError(f"algorithm.params.weight_clip must be [lo, hi], got {self.weight_clip!r}")
        object.__setattr__(self, "weight_clip", w)

    def loss_kwargs(self) -> dict:
        return {**super().loss_kwargs(), "tau": self.tau, "weight_clip": self.weight_clip,
                "safety_thresh": self.safety_thresh, "drop_multi_dual_clip": self.drop_multi_dual_clip}


PPO_CRITICS = ("trunk", "separate")
"""The kinds of ``critic_kinds.CRITIC_KINDS`` PPO accepts."""


@dataclass(frozen=True, kw_only=True)
class PPOParams(AlgorithmParams):
    """PPO with GAE and a value head on the actor trunk."""

    clip_eps: float = 0.2
    """Policy clip range."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten advantages over the global batch (masked, across DP), as peers do."""
    vf_coef: float = 0.5
    """Weight of the value loss against the policy loss on the shared trunk (``critic: trunk``); a
    separate critic minimises the value loss itself."""
    value_clip: Optional[float] = 0.2
    """Clip of the new value around the old one in the value loss (None: unclipped)."""
    critic: str = "trunk"
    """``trunk``: a value head on the actor's final hidden state, trained with the policy (one model, one
    optimizer, one clip). ``separate``: a value model of its own, as verl / OpenRLHF build it: a GPTModel
    of the actor's architecture and layout, initialised from the actor's starting weights (after a
    warm-up), with a zero-initialised value head, its own DDP, optimizer (``optim.critic_lr`` for all of
    it), gradient clip and checkpoint; the policy's gradients then carry no value loss."""

    def __post_init__(self) -> None:
        check_critic(self.critic, PPO_CRITICS)

    def estimator_kwargs(self) -> dict:
        return {"gamma": self.gamma, "lam": self.lam}

    def advantage_post(self) -> AdvantagePost:
        return AdvantagePost(whiten=self.whiten_advantages)

    def critic_name(self) -> Optional[str]:
        return self.critic

    def loss_kwargs(self) -> dict:
        return {"clip_eps": self.clip_eps}


CRITICS = ("tac", "standard", "trunk")
"""The kinds of ``critic_kinds.CRITIC_KINDS`` CompPO accepts."""


@dataclass(frozen=True, kw_only=True)
class CompPOFields(AlgorithmParams):
    """CompPO's own knobs (DESIGN.md "CompPO"): the gate, its controls, the critic, the phase controller.

    Shared by ``comppo`` (PPO clip) and ``comppo_fipo`` (FIPO's Future-KL weighted loss)."""

    lam: float = 0.95
    """Comp-GAE lambda."""
    k_lo: float = 0.1
    """Lower end of the gate envelope."""
    k_hi: float = 0.9
    """Upper end of the gate envelope."""
    gate_tau: float = 4.0
    """Sharpness of the gate's sigmoid in the normalised concentration."""
    gate_sink_keys: int = 0
    """Attention-sink keys left out of the gate's concentration ``H``: the first ``gate_sink_keys``
    positions, the distribution renormalised over the rest (0: off, the paper's gate). ``tools/gate_stats.py``
    measures how much of ``H`` they supply."""
    gate_control: str = "dynamic"
    """``dynamic`` (the gate from attention), ``fixed`` (``fixed_gate`` everywhere), ``shuffle`` (a global
    permutation of the batch's gates over valid response positions) or ``position`` (mean gate in
    ``position_bins`` bins of t/T, collected for ``position_steps`` iterations, then frozen)."""
    fixed_gate: float = 0.61
    """The ``fixed`` control's gate (the paper's mean gate on math)."""
    position_bins: int = 20
    """Bins of relative position t/T of the ``position`` control."""
    position_steps: int = 10
    """Iterations whose dynamic gates build the ``position`` schedule (dynamic gates are used meanwhile)."""
    critic: str = "tac"
    """``tac`` (the transport-aligned critic), ``standard`` (a linear head on the detached final hidden
    state) or ``trunk`` (PPO's head: on the final hidden state, not detached, clipped with the policy; with
    ``gate_control: fixed`` at PPO's gamma and PPO's settings it reproduces ``ppo`` bit for bit)."""
    critic_layers: int = 4
    """TAC: how many of the last layers' hidden states are fused (L')."""
    critic_top_k: int = 64
    """TAC: keys of the final-layer attention pooled into the history summary."""
    critic_warmup_steps: int = 0
    """Iterations the critic trains before its values enter the advantages (V = 0 until then)."""
    value_clamp: float = 1.0
    """The critic's output is clamped to ``[-value_clamp, value_clamp]``."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    value_clip: Optional[float] = 0.5
    """Value-loss clip (None: unclipped)."""
    adv_clip: Optional[float] = 5.0
    """Advantages are clipped to ``[-adv_clip, adv_clip]`` (None: off)."""
    whiten_advantages: bool = False
    """Whiten advantages over the global batch."""
    phase_controller: bool = False
    """Run the stable / warning / strong / hard-stop controller (``credit.phase``) on each step's metrics."""
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
        check_critic(self.critic, CRITICS)
        if self.gate_sink_keys < 0:
            raise ValueError(f"algorithm.params.gate_sink_keys must be >= 0, got {self.gate_sink_keys}")
        for name in ("position_bins", "critic_layers", "critic_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"algorithm.params.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.fixed_gate <= 1.0:
            raise ValueError(f"algorithm.params.fixed_gate must be in [0, 1], got {self.fixed_gate}")

    def estimator_kwargs(self) -> dict:
        return {"lam": self.lam}

    def gate_control_settings(self) -> tuple[str, dict]:
        """The gate control's name in ``gate_controls.GATE_CONTROLS`` and its keywords."""
        return self.gate_control, {"fixed_gate": self.fixed_gate, "position_bins": self.position_bins,
                                   "position_steps": self.position_steps}

    def advantage_post(self) -> AdvantagePost:
        return AdvantagePost(critic_warmup_steps=self.critic_warmup_steps, whiten=self.whiten_advantages,
                             clip=self.adv_clip)

    def critic_name(self) -> Optional[str]:
        return self.critic

    def phase_control(self) -> Optional[PhaseThresholds]:
        return self.phase_thresholds if self.phase_controller else None


@dataclass(frozen=True, kw_only=True)
class CompPPOParams(CompPOFields):
    """CompPO: Comp-GAE advantages, PPO's symmetric clip (the paper's Table 13)."""

    clip_eps: float = 0.2
    """Policy clip range (the phase controller moves it)."""

    def loss_kwargs(self) -> dict:
        return {"clip_eps": self.clip_eps}


@dataclass(frozen=True, kw_only=True)
class CompFIPOParams(CompPOFields, FIPOParams):
    """``comppo_fipo``: Comp-GAE advantages inside FIPO's Future-KL weighted DAPO loss."""
