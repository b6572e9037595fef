"""What one RL iteration reads (``trainer/step.py`` takes a :class:`Context`): the recipe sections it
reads, the algorithm (``algorithm/base.py``: its config in force and its state across iterations), the
models, the rollout source, the knobs in force, and the few collectives the iteration needs (DP whitening, the
finite-loss vote; the metric reduction is ``metrics/sums.py``'s). ``trainer/loop.py`` builds it once per
launch. No megatron import: the process groups and ranks come from the actor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_credit.algorithm.knobs import StepKnobs
from megatron_credit.metrics.sums import Reduction

if TYPE_CHECKING:  # annotations only: nothing of these is imported at run time here
    from megatron_credit.algorithm.base import Algorithm
    from megatron_credit.recipe.sections import AlgorithmConfig, TrainConfig
    from megatron_credit.trainer.actor import Actor
    from megatron_credit.credit_maps.writer import CreditMaps
    from megatron_credit.sources import RolloutSource, Weights


class PhaseTimer:
    """Wall-clock seconds per part of the current iteration (rollout, update, ...)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0


@dataclasses.dataclass
class Context:
    """What one iteration needs (``step.py`` reads these; it never imports megatron). No field is the whole
    recipe: ``trainer.loop.build`` hands over the sections and values the iteration reads."""

    algorithm: Algorithm
    """The algorithm (``algorithm/catalog.py``, built from the recipe's ``algorithm.name`` and ``params``):
    estimator, loss, aggregation, critic, capture, and its state across iterations."""
    actor: Actor
    """The policy (``trainer/actor.py``, the one megatron-facing file)."""
    rollouts: RolloutSource
    """Where batches come from: ``next(step, weights=...)`` (``sources/``, the class of
    ``rollout.mode``: engines, rewards, dynamic sampling; the weights are handed over by :meth:`weights`)."""
    pad_id: int
    """The tokenizer's pad id."""
    seq_multiple: int
    """Micro-batch lengths are multiples of this (:func:`seq_multiple`)."""
    train: TrainConfig
    """The recipe's ``train`` section (the micro-batch plan, ``fuse_old_logprob``; read-only)."""
    algorithm_section: AlgorithmConfig
    """The recipe's ``algorithm`` section (``kl_estimator``, ``tis_cap``; read-only)."""
    base_knobs: StepKnobs
    """The recipe's own knobs (``algorithm.knobs.base_knobs``); the algorithm's state may move them."""
    norm_length: int
    """Dr.GRPO's fixed length ``L`` of the loss denominator: ``rollout.max_response_len``."""
    seed: int
    """The run's seed (the algorithm's state may draw from it)."""
    critic: Optional[Actor] = None
    """The separate value model (``trainer.critic_model``), or None (no critic, or a head on the actor)."""
    knobs: Optional[StepKnobs] = None
    """The knobs of the next iteration (``base_knobs``, or as the algorithm's state moved them)."""
    credit_maps: Optional[CreditMaps] = None
    """The credit-map writer (``credit_maps/writer.py``: ``logging.credit_map_every``), or None (off)."""
    timer: PhaseTimer = dataclasses.field(default_factory=PhaseTimer)
    reduction: Reduction = dataclasses.field(init=False)
    """How the iteration's sums become its metrics (``metrics/sums.Reduction``): over DP x CP on the last
    stage, handed to the pipeline's first stage, named by the algorithm's and the model's tables."""

    def __post_init__(self) -> None:
        if self.knobs is None:
            self.knobs = self.base_knobs
        a = self.actor
        self.reduction = Reduction((*self.algorithm.metrics, *a.metric_tables), group=a.dp_cp_group, device=a.device,
                                   pp_group=a.pp_group if a.pp_size > 1 else None, pp_src=a.pp_last_rank)
        group = self.actor.dp_group
        self.algorithm.start(seed=self.seed, dp_rank=dist.get_rank(group), dp_group=group, device=self.actor.device)

    def after_iteration(self, metrics: dict[str, float]) -> dict[str, float]:
        """Hand the iteration's metrics to the algorithm; the next iteration runs with the knobs it gives.
        Returns what it logs ({} for most algorithms)."""
        logged = self.algorithm.after_iteration(metrics)
        if logged:
            self.knobs = self.algorithm.knobs(self.base_knobs)
        return logged

    def load_algorithm_state(self, state: Optional[dict]) -> None:
        """A checkpoint's algorithm state; the knobs follow it (a resumed run's)."""
        self.algorithm.load_state_dict(state)
        if state:
            self.knobs = self.algorithm.knobs(self.base_knobs)

    def weights(self, version: int) -> Weights:
        """The actor's weights as ``version`` (the RL iterations they completed), for the rollout source:
        their HF-named buckets, streamed when the source asks (every rank joins the gathers)."""
        from megatron_credit.sources.base import Weights

        return Weights(version=version, buckets=self.actor.hf_weight_buckets)

    def check_length(self, length: int) -> None:
        from megatron_credit.models import check_sequence_length

        check_sequence_length(self.actor.hf_config, length, what="a prompt + response")

    def whiten(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(A - mean) / std`` over the valid tokens of the whole global batch (summed over DP)."""
        m = mask.bool()
        s = torch.stack([torch.where(m, adv, 0.0).sum(), torch.where(m, adv * adv, 0.0).sum(),
                         m.sum().float()]).double().to(self.actor.device)
        if dist.get_world_size(self.actor.dp_group) > 1:
            dist.all_reduce(s, group=self.actor.dp_group)
        mean = s[0] / s[2].clamp(min=1)
        var = (s[1] / s[2].clamp(min=1) - mean * mean).clamp(min=0)
        mean, std = torch.stack([mean, torch.sqrt(var + 1e-8)]).to(adv.device).unbind()  # one copy to the batch's device
        return torch.where(m, (adv - mean) / std, 0.0).float()

    def all_finite(self, x: torch.Tensor) -> bool:
        bad = (~torch.isfinite(x)).any().to(torch.float64).reshape(1).to(self.actor.device)  # no read yet
        dist.all_reduce(bad)
        return float(bad) == 0.0  # the one read
