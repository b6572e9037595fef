"""Algorithms by name: advantage estimators, policy losses, and the pairs that make each algorithm.

The one place where an algorithm's name means something (STYLE rule 3). The trainer resolves
``ALGORITHMS.get(name)`` once at start-up and then calls the estimator and loss it names; hyperparameters
are explicit keywords of each function (a config passes them through, nothing is read implicitly).

>>> ALGORITHMS.get("fipo").policy_loss, ALGORITHMS.get("fipo").advantage_estimator
('fipo', 'grpo')
>>> ALGORITHMS.get("fipo").make_params({"tau": 16}).tau
16.0
>>> POLICY_LOSSES.get("trpo")
Traceback (most recent call last):
...
ValueError: unknown policy loss 'trpo'; valid names: ['dapo', 'fipo', 'gspo', 'ppo']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_credit.credit import group
from megatron_credit.credit.future_kl import FIPO_DUAL_CLIP_C, FIPO_TAU, FIPO_WEIGHT_CLIP, LOG_RATIO_CLAMP
from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.phase import PhaseThresholds
from megatron_credit.losses import policy
from megatron_credit.registry import Registry
from megatron_credit.typed_build import build_dataclass


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """What an advantage estimator may read; each estimator names the fields it requires."""

    response_mask: torch.Tensor
    """``[N, T]`` bool or 0/1, 1 on response tokens; one response per row."""
    scores: Optional[torch.Tensor] = None
    """``[N]`` one (shaped) score per response (group estimators)."""
    group_ids: Optional[torch.Tensor] = None
    """``[N]`` integer id of each response's prompt group (group estimators)."""
    token_rewards: Optional[torch.Tensor] = None
    """``[N, T]`` per-token rewards, typically the score on the last token (GAE estimators)."""
    values: Optional[torch.Tensor] = None
    """``[N, T]`` critic values (GAE estimators)."""
    gates: Optional[torch.Tensor] = None
    """``[N, T]`` CompPO transport gates kappa (Comp-GAE)."""

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"this advantage estimator needs AdvantageInputs fields {missing}")


@dataclass(frozen=True, kw_only=True)
class AdvantageOutput:
    """Result of an advantage estimator."""

    advantages: torch.Tensor
    """``[N, T]`` detached advantages, 0 on masked tokens."""
    returns: Optional[torch.Tensor] = None
    """``[N, T]`` value targets (GAE estimators only)."""


AdvantageEstimator = Callable[..., AdvantageOutput]
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_estimator(inputs: AdvantageInputs, *, norm_by_std: bool = True,
                   eps: float = 1e-6) -> AdvantageOutput:
    """GRPO (also DAPO, GSPO, FIPO): group-normalised score broadcast to tokens."""
    inputs.require("scores", "group_ids")
    adv = group.grpo_advantages(inputs.scores, inputs.group_ids, norm_by_std=norm_by_std, eps=eps)
    return AdvantageOutput(advantages=group.broadcast_to_tokens(adv, inputs.response_mask))


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_estimator(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr.GRPO: score minus group mean, broadcast to tokens."""
    inputs.require("scores", "group_ids")
    adv = group.dr_grpo_advantages(inputs.scores, inputs.group_ids)
    return AdvantageOutput(advantages=group.broadcast_to_tokens(adv, inputs.response_mask))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_estimator(inputs: AdvantageInputs) -> AdvantageOutput:
    """RLOO: score minus the leave-one-out group mean, broadcast to tokens."""
    inputs.require("scores", "group_ids")
    adv = group.rloo_advantages(inputs.scores, inputs.group_ids)
    return AdvantageOutput(advantages=group.broadcast_to_tokens(adv, inputs.response_mask))


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95,
                  cp_group: Any = None) -> AdvantageOutput:
    """PPO's GAE over per-token rewards and critic values (``cp_group``: inputs are CP shards)."""
    inputs.require("token_rewards", "values")
    adv, ret = gae(inputs.token_rewards, inputs.values, inputs.response_mask, gamma=gamma, lam=lam,
                   cp_group=cp_group)
    return AdvantageOutput(advantages=adv, returns=ret)


@ADVANTAGE_ESTIMATORS.register("comp_gae")
def comp_gae_estimator(inputs: AdvantageInputs, *, lam: float = 0.95, cp_group: Any = None) -> AdvantageOutput:
    """CompPO's Comp-GAE: GAE with the per-token gate kappa in place of gamma (``cp_group`` as GAE)."""
    inputs.require("token_rewards", "values", "gates")
    adv, ret = comp_gae(inputs.token_rewards, inputs.values, inputs.gates, inputs.response_mask, lam=lam,
                        cp_group=cp_group)
    return AdvantageOutput(advantages=adv, returns=ret)


# Every policy loss takes ``cp_group`` (None or the context-parallel group), so the trainer calls each
# the same way; those whose math is per-token ignore it.
@POLICY_LOSSES.register("ppo")
def ppo_loss(logp, old_logp, advantages, response_mask, *, clip_eps: float = 0.2,
             dual_clip_c: Optional[float] = None, is_weights=None, cp_group: Any = None):
    """Vanilla PPO: symmetric clip ``[1 - eps, 1 + eps]``, dual clip off unless given."""
    return policy.ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low=clip_eps,
                                clip_high=clip_eps, dual_clip_c=dual_clip_c, is_weights=is_weights)


@POLICY_LOSSES.register("dapo")
def dapo_loss(logp, old_logp, advantages, response_mask, *, clip_low: float = 0.2, clip_high: float = 0.28,
              dual_clip_c: Optional[float] = 3.0, is_weights=None, cp_group: Any = None):
    """DAPO: asymmetric clip 0.2 / 0.28 and dual clip ``c`` for negative advantages."""
    return policy.ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low=clip_low,
                                clip_high=clip_high, dual_clip_c=dual_clip_c, is_weights=is_weights)


POLICY_LOSSES.add("gspo", policy.gspo_loss)


@POLICY_LOSSES.register("fipo")
def fipo_loss(logp, old_logp, advantages, response_mask, *, drop_multi_dual_clip: bool = False,
              dual_clip_c: float = FIPO_DUAL_CLIP_C, cp_group: Any = None, **kwargs):
    """FIPO: :func:`~megatron_credit.losses.policy.fipo_policy_loss` (Future-KL weights computed on this
    rank's CP shard with the carry exchange over ``cp_group``), optionally dropping whole responses with
    more than one dual-clipped token (the published code's rule; counts summed over CP)."""
    from megatron_credit.credit.future_kl import multi_dual_clip_keep

    if drop_multi_dual_clip:
        keep = multi_dual_clip_keep(logp, old_logp, advantages, response_mask,
                                    dual_clip_c=dual_clip_c, cp_group=cp_group)
        response_mask = response_mask.bool() & keep[:, None]
    return policy.fipo_policy_loss(logp, old_logp, advantages, response_mask, dual_clip_c=dual_clip_c,
                                   cp_group=cp_group, **kwargs)


# ---------------------------------------------------------------------------------------------------
# Typed parameters. Each algorithm has one keyword-only dataclass; ``estimator_kwargs`` /
# ``loss_kwargs`` say which fields go to which function, so a recipe's ``algorithm.params`` reaches the
# math in one hop and the trainer never looks at an algorithm's name.


@dataclass(frozen=True, kw_only=True)
class ClipParams:
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
class DAPOParams:
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
class GSPOParams:
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


@dataclass(frozen=True, kw_only=True)
class PPOParams:
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
        if self.critic not in PPO_CRITICS:
            raise ValueError(f"algorithm.params.critic={self.critic!r}: valid values {list(PPO_CRITICS)}")

    def estimator_kwargs(self) -> dict:
        return {"gamma": self.gamma, "lam": self.lam}

    def loss_kwargs(self) -> dict:
        return {"clip_eps": self.clip_eps}


GATE_CONTROLS = ("dynamic", "fixed", "shuffle", "position")
CRITICS = ("tac", "standard", "trunk")


@dataclass(frozen=True, kw_only=True)
class CompPOFields:
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
        if self.critic not in CRITICS:
            raise ValueError(f"algorithm.params.critic={self.critic!r}: valid values {list(CRITICS)}")
        if self.gate_sink_keys < 0:
            raise ValueError(f"algorithm.params.gate_sink_keys must be >= 0, got {self.gate_sink_keys}")
        for name in ("position_bins", "critic_layers", "critic_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"algorithm.params.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.fixed_gate <= 1.0:
            raise ValueError(f"algorithm.params.fixed_gate must be in [0, 1], got {self.fixed_gate}")

    def estimator_kwargs(self) -> dict:
        return {"lam": self.lam}


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


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """An algorithm = an advantage estimator + a policy loss + how the loss is reduced + its params."""

    advantage_estimator: str
    """Name in ``ADVANTAGE_ESTIMATORS``."""
    policy_loss: str
    """Name in ``POLICY_LOSSES``."""
    loss_agg_mode: str
    """One of ``megatron_credit.losses.aggregation.AGG_MODES``."""
    params_cls: type = DAPOParams
    """The keyword-only dataclass of this algorithm's parameters."""
    needs_critic: bool = False
    """Whether a value model is trained (GAE estimators)."""
    needs_gates: bool = False
    """Whether the actor forward must produce CompPO gates."""

    def __post_init__(self) -> None:
        ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)  # raise ValueError listing valid names
        POLICY_LOSSES.get(self.policy_loss)
        if self.loss_agg_mode not in policy.AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} not in {list(policy.AGG_MODES)}")

    def make_params(self, overrides: Any = None, *, where: str = "params"):
        """The parameter dataclass with ``overrides`` (a mapping) applied; unknown keys and wrong types
        raise ``ValueError`` naming the field."""
        return build_dataclass(self.params_cls, dict(overrides or {}), where)

    def estimate(self, inputs: AdvantageInputs, params: Any, *, cp_group: Any = None) -> AdvantageOutput:
        """Advantages of ``inputs`` with this algorithm's estimator and ``params``."""
        fn = ADVANTAGE_ESTIMATORS.get(self.advantage_estimator)
        kwargs = params.estimator_kwargs()
        if self.needs_critic:
            kwargs["cp_group"] = cp_group
        return fn(inputs, **kwargs)

    def loss(self, logp, old_logp, advantages, response_mask, params: Any, *, cp_group: Any = None,
             is_weights=None):
        """Per-token policy loss ``[B, T]`` and detached metrics (see ``losses.policy``)."""
        fn = POLICY_LOSSES.get(self.policy_loss)
        return fn(logp, old_logp, advantages, response_mask, cp_group=cp_group, is_weights=is_weights,
                  **params.loss_kwargs())

    @property
    def agg_required_args(self) -> tuple[str, ...]:
        """The ``aggregate_loss`` keywords the trainer must compute once per step for this algorithm
        (e.g. Dr.GRPO's ``norm_length``, the fixed maximum response length)."""
        return policy.AGG_REQUIRED_ARGS[self.loss_agg_mode]

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, **denominators: Any) -> torch.Tensor:
        """:func:`~megatron_credit.losses.aggregation.aggregate_loss` in this algorithm's mode, refusing
        to run without every argument of :attr:`agg_required_args` (no silently local denominators)."""
        missing = [k for k in self.agg_required_args if denominators.get(k) is None]
        if missing:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} needs {missing}")
        return policy.aggregate_loss(per_token, mask, mode=self.loss_agg_mode, **denominators)


ALGORITHMS: Registry[AlgorithmSpec] = Registry("algorithm")
for _name, _spec in {
    "grpo": AlgorithmSpec(advantage_estimator="grpo", policy_loss="ppo", loss_agg_mode="seq-mean-token-mean",
                          params_cls=GRPOParams),
    "dapo": AlgorithmSpec(advantage_estimator="grpo", policy_loss="dapo", loss_agg_mode="token-mean",
                          params_cls=DAPOParams),
    # Dr.GRPO divides by a fixed L: spec.aggregate(...) requires norm_length (see agg_required_args).
    "dr_grpo": AlgorithmSpec(advantage_estimator="dr_grpo", policy_loss="ppo",
                             loss_agg_mode="seq-mean-token-sum-norm", params_cls=ClipParams),
    "rloo": AlgorithmSpec(advantage_estimator="rloo", policy_loss="ppo", loss_agg_mode="token-mean",
                          params_cls=ClipParams),
    "gspo": AlgorithmSpec(advantage_estimator="grpo", policy_loss="gspo",
                          loss_agg_mode="seq-mean-token-mean", params_cls=GSPOParams),
    "ppo": AlgorithmSpec(advantage_estimator="gae", policy_loss="ppo", loss_agg_mode="token-mean",
                         params_cls=PPOParams, needs_critic=True),
    "fipo": AlgorithmSpec(advantage_estimator="grpo", policy_loss="fipo", loss_agg_mode="token-mean",
                          params_cls=FIPOParams),
    "comppo": AlgorithmSpec(advantage_estimator="comp_gae", policy_loss="ppo", loss_agg_mode="token-mean",
                            params_cls=CompPPOParams, needs_critic=True, needs_gates=True),
    "comppo_fipo": AlgorithmSpec(advantage_estimator="comp_gae", policy_loss="fipo", loss_agg_mode="token-mean",
                                 params_cls=CompFIPOParams, needs_critic=True, needs_gates=True),
}.items():
    ALGORITHMS.add(_name, _spec)


# KL penalty estimators to a frozen reference policy, per token (Schulman's k1 / k3; verl's low_var_kl).
KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` (unbiased, can be negative)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r`` with ``r = pi_ref / pi`` (unbiased, never negative)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10] (verl's ``low_var_kl``)."""
    return kl_k3(logp, ref_logp).clamp(-10.0, 10.0)
