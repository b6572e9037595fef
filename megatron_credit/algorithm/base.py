"""What an RL algorithm is: a typed :class:`Algorithm.Config` (its parameters, ``algorithm.params``) that
``build()``s an :class:`Algorithm` (its estimator, loss, post-processing, critic, metrics, capture and
state). The shape is torchtitan's configurable components: each algorithm class declares its own nested
``Config`` dataclass, and ``Config.build()`` makes the class that declared it, so a parameter reaches the
math as ``self.config.<field>`` in one hop and every default is written once, on its field.

The trainer (``trainer/step.py``) calls the methods below and reads no field of a config by name; a
recipe's ``algorithm.name`` is resolved once, in ``algorithm/catalog.py``. No megatron import.

>>> from megatron_credit.algorithm.grpo import GRPO
>>> GRPO.Config(clip_eps=0.1).build().config.clip_eps
0.1
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Mapping, Optional

import torch

from megatron_credit.algorithm.capture import Capture
from megatron_credit.algorithm.critic_kinds import CRITIC_KINDS, CriticKind, check_critic
from megatron_credit.algorithm.knobs import StepKnobs
from megatron_credit.metrics.tables import MetricTable
from megatron_credit.losses import aggregation, policy, value
from megatron_credit.typed_build import NonNegativeFloat, Range, build_dataclass


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
    obs_mask: Optional[torch.Tensor] = None
    """``[N, T]`` bool, True on the environment's tokens inside a multi-turn trajectory (observations, never
    in ``response_mask``): the per-token recurrences pass across them (docs/multi_turn.md); None:
    single-turn."""
    extras: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``[N, T]`` inputs of the algorithm's own, by name (what :meth:`Algorithm.advantage_inputs` adds)."""

    def require(self, *names: str) -> None:
        """Refuse to estimate without the fields (or ``extras``) ``names``."""
        missing = [n for n in names if (self.extras.get(n) if n not in _INPUT_FIELDS else getattr(self, n)) is None]
        if missing:
            raise ValueError(f"this advantage estimator needs AdvantageInputs fields {missing}")


_INPUT_FIELDS = {f.name for f in dataclasses.fields(AdvantageInputs)}


@dataclass(frozen=True, kw_only=True)
class AdvantageOutput:
    """Result of an advantage estimator."""

    advantages: torch.Tensor
    """``[N, T]`` detached advantages, 0 on masked tokens."""
    returns: Optional[torch.Tensor] = None
    """``[N, T]`` value targets (GAE estimators only)."""


@dataclass(frozen=True, kw_only=True)
class AdvantagePost:
    """What happens to the estimator's advantages before the update (``trainer/step.compute_advantages``)."""

    critic_warmup_steps: int = 0
    """Iterations whose advantages use V = 0 (the critic trains on their returns but is not trusted yet)."""
    whiten: bool = False
    """Whiten over the global batch (masked, summed over DP)."""
    clip: Optional[float] = None
    """Clip to ``[-clip, clip]`` (None: off)."""


Metrics = dict[str, torch.Tensor]

ClipFraction = Annotated[float, Range(ge=0, lt=1)]
"""A clip of the ratio below 1 (``1 - eps`` must stay above 0): PPO's ``clip_eps``, DAPO's ``clip_low``."""


class Algorithm:
    """One RL algorithm, built from its :class:`Config` (module docstring). Every subclass declares its own
    nested ``Config`` (a subclass of its parent's, empty when it adds no field: a ``Config`` builds the
    class that declares it, so one inherited would build the parent), and overrides :meth:`estimate` and
    :meth:`loss`; the other methods have the defaults of an algorithm without a critic, a capture or
    state."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        """An algorithm's parameters (``algorithm.params``), checked when constructed."""

        def build(self) -> "Algorithm":
            """The algorithm whose class declared this ``Config``."""
            return type(self)._owner(self)

        @classmethod
        def from_mapping(cls, data: Optional[Mapping[str, Any]] = None, *, where: str = "algorithm.params"):
            """This config from a recipe's mapping; an unknown key or a wrong type is one ``ValueError``
            naming the field (``typed_build``)."""
            return build_dataclass(cls, dict(data or {}), where)

    loss_agg_mode: ClassVar[str] = "token-mean"
    """How the per-token loss is reduced: one of ``losses.aggregation.AGG_MODES``."""
    metrics: ClassVar[tuple[MetricTable, ...]] = ()
    """The metric tables of what this algorithm logs beyond the trainer's own (``metrics/tables.py``)."""
    side_channels: ClassVar[tuple[str, ...]] = ()
    """The batch's side channels (a capture's outputs, :meth:`behaviour_extras`) that :meth:`loss` takes,
    each as the keyword of its name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Config" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} must declare its own nested Config (a subclass of its parent's, empty "
                            "when it adds no field): a Config builds the class that declares it")
        cls.Config._owner = cls
        if cls.loss_agg_mode not in aggregation.AGG_MODES:
            raise ValueError(f"{cls.__name__}.loss_agg_mode={cls.loss_agg_mode!r} not in {list(aggregation.AGG_MODES)}")

    def __init__(self, config: "Algorithm.Config") -> None:
        self.recipe_config = config
        """The parameters as the recipe gives them."""
        self.config = config
        """The parameters in force (an algorithm's state may move them between iterations, as a phase
        controller moves its clips)."""

    # --- advantages -------------------------------------------------------------------------------------
    def estimate(self, inputs: AdvantageInputs, *, cp_group: Any = None) -> AdvantageOutput:
        """Advantages (and returns) of ``inputs``: whole sequences, or CP shards with ``cp_group``."""
        raise NotImplementedError

    def advantage_inputs(self, side: Mapping[str, torch.Tensor], mask: torch.Tensor,
                         iteration: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What the estimator gets beyond the trainer's inputs, from the batch's side channels ``side``
        (``[B, T]`` each), and its ``sum:`` statistics; ({}, {}) for most algorithms."""
        return {}, {}

    @property
    def advantage_post(self) -> AdvantagePost:
        """What happens to the advantages before the update (none by default)."""
        return AdvantagePost()

    # --- the policy loss --------------------------------------------------------------------------------
    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, *, cp_group: Any = None, is_weights: Optional[torch.Tensor] = None,
             row_slots: Optional[torch.Tensor] = None, **side: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """Per-token policy loss ``[B, T]`` and detached rank-local statistics (``losses.policy``).
        ``cp_group``: the inputs are context-parallel shards; ``is_weights``: truncated importance weights;
        ``row_slots`` (``[B, T]`` bool): False at slots a loss that scans along the row passes unchanged (a
        packed row's empty slots under CP, a multi-turn trajectory's observations)
        (``batch/packing.py``); ``side``: the :attr:`side_channels`."""
        raise NotImplementedError

    def behaviour_extras(self, batch: Any) -> dict[str, torch.Tensor]:
        """Side channels ``{name: [B, T]}`` made after the behaviour pass on the last pipeline stage
        (``batch``: the ``batch.train_batch.TrainBatch`` with ``old_logp``); each travels with the micro-batches
        to :meth:`loss`, which must name it in :attr:`side_channels`. None by default."""
        return {}

    def credit_fields(self, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, side: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This algorithm's own per-token quantities of credit ``{name: [B, T]}`` (detached, whole rows, on the
        inputs' device), for the credit maps and diagnostics (``credit_maps/writer.py``). ``logp``: the
        log-probs of the update's forward (the policy that updated on each row), ``old_logp``: the
        behaviour's, ``advantages``: the estimator's (after :attr:`advantage_post`), ``mask``: the response
        tokens, ``side``: the batch's side channels. The name ``advantage``, when returned, is the credit
        the loss applies to each token in place of the estimator's (FIPO's ``f_t * A_t``). {} by default."""
        return {}

    @property
    def agg_required_args(self) -> tuple[str, ...]:
        """The ``aggregate_loss`` keywords the trainer computes once per step for this algorithm (Dr.GRPO's
        ``norm_length``, the fixed maximum response length, ...)."""
        return aggregation.AGG_REQUIRED_ARGS[self.loss_agg_mode]

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, **denominators: Any) -> torch.Tensor:
        """:func:`~megatron_credit.losses.aggregation.aggregate_loss` in :attr:`loss_agg_mode`, refusing to
        run without every argument of :attr:`agg_required_args` (no silently local denominators)."""
        missing = [k for k in self.agg_required_args if denominators.get(k) is None]
        if missing:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} needs {missing}")
        return aggregation.aggregate_loss(per_token, mask, mode=self.loss_agg_mode, **denominators)

    # --- what the actor is built with -------------------------------------------------------------------
    @property
    def critic_kind(self) -> Optional[CriticKind]:
        """The critic this algorithm trains (``critic_kinds``), or None."""
        return None

    def capture(self, *, top_k: int = 0) -> Optional[Capture]:
        """What this algorithm reads inside the behaviour pass's forward (``algorithm/capture.py``;
        ``top_k``: the keys its critic kind asks for), or None."""
        return None

    def actor_options(self, hf_config, *, dtype, pp_size: int = 1) -> dict:
        """The :class:`~megatron_credit.trainer.actor.Actor` keywords this algorithm needs: ``with_critic``
        (a value head on the actor, unless the critic is a separate model, ``trainer.critic_model``), the
        critic kind's own keywords (a critic on the actor's detached features) and the behaviour pass's
        ``capture``."""
        kind = self.critic_kind
        out = {"with_critic": kind is not None and not kind.separate_model}
        if kind is not None and kind.actor_options is not None:
            out.update(kind.actor_options(self.config, hf_config, dtype=dtype, pp_size=pp_size))
        out["capture"] = self.capture(top_k=out.pop("capture_top_k", 0))
        return out

    # --- the critic ---------------------------------------------------------------------------------------
    def value_loss(self, values, old_values, returns, mask, *, global_num_tokens) -> tuple[torch.Tensor, Metrics]:
        """The critic's loss ``[]`` and its ``sum:`` statistics (an algorithm with a critic)."""
        raise NotImplementedError(f"{type(self).__name__} trains no critic")

    @property
    def value_weight(self) -> float:
        """Weight of the value loss against the policy loss on a shared trunk."""
        raise NotImplementedError(f"{type(self).__name__} trains no critic")

    def critic_stats(self, values, returns, mask) -> dict:
        """The ``sum:`` diagnostics of the critic kind (``CriticKind.diagnostics``) for ``values, returns,
        mask: [B, T]`` after the advantages; {} without."""
        kind = self.critic_kind
        if kind is None or kind.diagnostics is None:
            return {}
        return kind.diagnostics(values, returns, mask, self.config)

    # --- state across iterations --------------------------------------------------------------------------
    def start(self, *, seed: int, dp_rank: int, dp_group: Any = None, device: Any = None) -> None:
        """Build what the algorithm keeps across iterations, once per launch (``seed`` and ``dp_rank`` seed
        its draws; ``dp_group`` / ``device`` carry its collectives). Nothing by default."""

    def knobs(self, base: StepKnobs) -> StepKnobs:
        """The trainer's knobs for the next iteration from the recipe's own (``base``)."""
        return base

    def after_iteration(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The iteration's metrics, after it; returns what to log. When it returns something, the trainer
        reads :meth:`knobs` again."""
        return {}

    def state_dict(self) -> dict:
        """What this algorithm keeps across iterations, saved with each checkpoint."""
        return {}

    def load_state_dict(self, state: Optional[Mapping]) -> None:
        """What :meth:`state_dict` saved (a part it does not keep, or a missing one, is left as it is)."""


Algorithm.Config._owner = Algorithm


class ActorCritic(Algorithm):
    """An algorithm with a critic: its kind (``critic_kinds``: the config's ``critic``, one of
    :attr:`critics`), the clipped value loss and its weight, and the advantage post-processing."""

    critics: ClassVar[tuple[str, ...]] = ("trunk",)
    """The critic kinds the config's ``critic`` may name."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Algorithm.Config):
        """The fields every critic algorithm has (each subclass sets their defaults)."""

        vf_coef: NonNegativeFloat = 0.5
        """Weight of the value loss added to the policy loss: against the policy on the shared trunk
        (``critic: trunk``), or the scale of the gradient of a critic on the actor's detached features
        (``tac``, ``standard``). A ``separate`` value model minimises the value loss itself, unweighted."""

        def __post_init__(self) -> None:
            if getattr(super(), "__post_init__", None):
                super().__post_init__()
            check_critic(self.critic, type(self)._owner.critics)

    @property
    def critic_kind(self) -> CriticKind:
        return CRITIC_KINDS.get(self.config.critic)

    def value_loss(self, values, old_values, returns, mask, *, global_num_tokens):
        """:func:`~megatron_credit.losses.value.clipped_value_loss` with the config's ``value_clip``."""
        loss, m = value.clipped_value_loss(values, old_values, returns, mask, value_clip=self.config.value_clip,
                                           global_num_tokens=global_num_tokens)
        return loss, {f"sum:{k}": v for k, v in m.items()}

    @property
    def value_weight(self) -> float:
        return self.config.vf_coef


class PPOClip(Algorithm):
    """PPO's clipped loss with a symmetric range ``[1 - eps, 1 + eps]`` and no dual clip, for the
    algorithms whose loss it is (their ``Config`` inherits ``clip_eps`` from here, written once)."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Algorithm.Config):
        """PPO's symmetric clip."""

        clip_eps: ClipFraction = 0.2
        """Clip range ``[1 - eps, 1 + eps]``."""

    def loss(self, logp, old_logp, advantages, response_mask, *, cp_group=None, is_weights=None, row_slots=None):
        eps = self.config.clip_eps
        return policy.ppo_clip_loss(logp, old_logp, advantages, response_mask, clip_low=eps, clip_high=eps,
                                    dual_clip_c=None, is_weights=is_weights)


def scaled(config: Algorithm.Config, **ratios: float) -> Algorithm.Config:
    """``config`` with each named field that it has and that is set multiplied by its ratio."""
    names = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{k: getattr(config, k) * r for k, r in ratios.items()
                                          if k in names and getattr(config, k) is not None})
