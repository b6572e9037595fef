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

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_credit.algorithm.params import (CRITICS, PPO_CRITICS, AdvantagePost,  # noqa: F401
                                              AlgorithmParams, ClipParams, CompFIPOParams, CompPOFields,
                                              CompPPOParams, DAPOParams, FIPOParams, GRPOParams, GSPOParams,
                                              PPOParams)
from megatron_credit.algorithm.capture import Capture, GateCapture
from megatron_credit.credit import group
from megatron_credit.algorithm.critic_kinds import CRITIC_KINDS, CriticKind
from megatron_credit.algorithm.gate_controls import GateControl
from megatron_credit.credit.future_kl import FIPO_DUAL_CLIP_C
from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.phase import PhaseController
from megatron_credit.losses import policy, value
from megatron_credit.losses.kl import KL_ESTIMATORS, kl_k1, kl_k3, kl_low_var  # noqa: F401  (re-exported)
from megatron_credit.algorithm.metric_tables import CRITIC, FIPO, GATES, MetricTable
from megatron_credit.algorithm.state import AlgorithmState
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


def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name``."""
    import inspect

    return name in inspect.signature(fn).parameters


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
              dual_clip_c: float = FIPO_DUAL_CLIP_C, cp_group: Any = None, row_slots=None, **kwargs):
    """FIPO: :func:`~megatron_credit.losses.policy.fipo_policy_loss` (Future-KL weights computed on this
    rank's CP shard with the carry exchange over ``cp_group``; ``row_slots`` as there), optionally dropping whole responses with
    more than one dual-clipped token (the published code's rule; counts summed over CP)."""
    from megatron_credit.credit.future_kl import multi_dual_clip_keep

    if drop_multi_dual_clip:
        keep = multi_dual_clip_keep(logp, old_logp, advantages, response_mask,
                                    dual_clip_c=dual_clip_c, cp_group=cp_group)
        response_mask = response_mask.bool() & keep[:, None]
    return policy.fipo_policy_loss(logp, old_logp, advantages, response_mask, dual_clip_c=dual_clip_c,
                                   cp_group=cp_group, row_slots=row_slots, **kwargs)


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
    """Whether Comp-GAE's transport gates are made (a gate control in its state, ``algorithm/state.py``, from
    the ``kappa`` its capture reads; the planner sizes CompPO's critic)."""
    behaviour_extras: Optional[Callable[[Any, Any], dict]] = None
    """Side channels: ``fn(batch, params) -> {name: [B, T] tensor}``, called on the last pipeline stage after
    the behaviour pass (``batch`` is the ``trainer.batch.TrainBatch`` with ``old_logp`` and whatever else the
    pass produced). Each tensor travels with the batch's micro-batches (cut, CP-split, on the actor's
    device) and reaches the policy loss as the keyword of its name."""
    metrics: tuple[MetricTable, ...] = ()
    """The metrics this algorithm adds to the trainer's own (``metric_tables``)."""
    capture_factory: Optional[Callable[..., Capture]] = None
    """``fn(params, *, top_k) -> Capture``: what the algorithm reads inside the behaviour pass's forward
    (``algorithm/capture.py``; ``top_k``: the keys its critic kind asks for), or None. Its outputs join the
    side channels by name."""

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
             is_weights=None, side: Optional[dict] = None, row_slots=None):
        """Per-token policy loss ``[B, T]`` and detached metrics (see ``losses.policy``); ``side``: this
        micro-batch's share of the batch's side channels (a capture's outputs, the
        :attr:`behaviour_extras` tensors), each passed as the keyword of its name when the loss has it. ``row_slots``
        (``[B, T]`` bool; packed micro-batches under CP, whose rows have empty slots inside them,
        ``data/packing.py``): handed to a loss that declares it (one that scans along the row: FIPO); a
        loss that only sums over masked tokens is not affected by the empty slots."""
        fn = POLICY_LOSSES.get(self.policy_loss)
        extra = {"row_slots": row_slots} if row_slots is not None and _takes(fn, "row_slots") else {}
        side = {k: v for k, v in (side or {}).items() if self.loss_takes(k)}  # the side channels it names
        return fn(logp, old_logp, advantages, response_mask, cp_group=cp_group, is_weights=is_weights,
                  **side, **extra, **params.loss_kwargs())

    def loss_takes(self, name: str) -> bool:
        """Whether the policy loss names the side channel ``name`` as a keyword (then :meth:`loss` hands it over)."""
        return _takes(POLICY_LOSSES.get(self.policy_loss), name)

    def critic_kind(self, params: AlgorithmParams) -> Optional[CriticKind]:
        """The critic this algorithm trains (``critic_kinds.CRITIC_KINDS``; ``trunk`` unless its parameters
        name another), or None for an algorithm without a critic."""
        return CRITIC_KINDS.get(params.critic_name() or "trunk") if self.needs_critic else None

    def capture(self, params: Any, *, top_k: int = 0) -> Optional[Capture]:
        """What this algorithm reads inside the behaviour pass's forward (:attr:`capture_factory`), or None."""
        return None if self.capture_factory is None else self.capture_factory(params, top_k=top_k)

    def actor_options(self, params: Any, hf_config, *, dtype, pp_size: int = 1) -> dict:
        """The :class:`~megatron_credit.trainer.actor.Actor` keywords this algorithm needs: ``with_critic``
        (a value head on the actor: critic algorithms, unless the critic is a separate model,
        ``trainer.critic_model``), the critic kind's own keywords (``critic_kinds``: a critic on the
        actor's detached features) and the behaviour pass's ``capture`` (:meth:`capture`)."""
        kind = self.critic_kind(params)
        out = {"with_critic": kind is not None and not kind.separate_model}
        if kind is not None and kind.actor_options is not None:
            out.update(kind.actor_options(params, hf_config, dtype=dtype, pp_size=pp_size))
        out["capture"] = self.capture(params, top_k=out.pop("capture_top_k", 0))
        return out

    def state(self, params: Any, *, seed: int, dp_rank: int, dp_group: Any = None, device: Any = None) -> AlgorithmState:
        """What this algorithm keeps across iterations (``algorithm/state.py``), saved with each checkpoint."""
        return AlgorithmState(self, params, seed=seed, dp_rank=dp_rank, dp_group=dp_group, device=device)

    def gate_control(self, params: Any, *, seed: int, dp_rank: int, dp_group: Any = None,
                     device: Any = None) -> Optional[GateControl]:
        """The transport-gate control of a gated algorithm (``gate_controls``: the one its parameters name,
        seeded by the run's ``seed`` and this ``dp_rank``; its collectives on ``device``), or None for others."""
        return GateControl(params, seed=seed, dp_rank=dp_rank, dp_group=dp_group,
                           device=device) if self.needs_gates else None

    def phase_controller(self, params: AlgorithmParams) -> Optional[PhaseController]:
        """The phase controller (``credit.phase``) its parameters ask for between iterations, or None."""
        thresholds = params.phase_control()
        return None if thresholds is None else PhaseController(thresholds)

    def critic_stats(self, values, returns, mask, params: AlgorithmParams) -> dict:
        """The ``sum:`` diagnostics of this algorithm's critic kind (``CriticKind.diagnostics``) for
        ``values, returns, mask: [B, T]`` after the advantages; {} without a critic or diagnostics."""
        kind = self.critic_kind(params)
        if kind is None or kind.diagnostics is None:
            return {}
        return kind.diagnostics(values, returns, mask, params)

    def advantage_post(self, params: AlgorithmParams) -> AdvantagePost:
        """What happens to this algorithm's advantages before the update (critic warm-up, whitening, clip)."""
        return params.advantage_post()

    def value_loss(self, values, old_values, returns, mask, params: Any, *, global_num_tokens):
        """The critic's loss ``[]`` (:func:`~megatron_credit.losses.value.clipped_value_loss` with this
        algorithm's ``value_clip``) and its ``sum:`` statistics."""
        loss, m = value.clipped_value_loss(values, old_values, returns, mask, value_clip=params.value_clip,
                                           global_num_tokens=global_num_tokens)
        return loss, {f"sum:{k}": v for k, v in m.items()}

    def value_weight(self, params: Any) -> float:
        """Weight of the value loss against the policy loss on a shared trunk (``vf_coef``)."""
        return params.vf_coef

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


def comppo_capture(params: Any, *, top_k: int = 0) -> GateCapture:
    """CompPO's capture: the dynamic gate ``kappa`` of DESIGN.md "CompPO" from the final layer's attention
    concentration, and ``top_k`` keys for its transport-aligned critic."""
    from megatron_credit.credit.gates import comppo_gate

    return GateCapture(functools.partial(comppo_gate, k_lo=params.k_lo, k_hi=params.k_hi, tau=params.gate_tau),
                       top_k=top_k, sink_keys=params.gate_sink_keys)


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
                         params_cls=PPOParams, needs_critic=True, metrics=(CRITIC,)),
    "fipo": AlgorithmSpec(advantage_estimator="grpo", policy_loss="fipo", loss_agg_mode="token-mean",
                          params_cls=FIPOParams, metrics=(FIPO,)),
    "comppo": AlgorithmSpec(advantage_estimator="comp_gae", policy_loss="ppo", loss_agg_mode="token-mean",
                            params_cls=CompPPOParams, needs_critic=True, needs_gates=True, metrics=(CRITIC, GATES),
                            capture_factory=comppo_capture),
    "comppo_fipo": AlgorithmSpec(advantage_estimator="comp_gae", policy_loss="fipo", loss_agg_mode="token-mean",
                                 params_cls=CompFIPOParams, needs_critic=True, needs_gates=True,
                                 metrics=(FIPO, CRITIC, GATES), capture_factory=comppo_capture),
}.items():
    ALGORITHMS.add(_name, _spec)


def actor_options(spec: AlgorithmSpec, params: Any, hf_config, *, dtype, pp_size: int = 1) -> dict:
    """``spec.actor_options(...)``: the Actor keywords of ``spec`` with ``params``."""
    return spec.actor_options(params, hf_config, dtype=dtype, pp_size=pp_size)
