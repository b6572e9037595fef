"""What every rollout source shares: the registry of modes, the source's contract, the weights the driver
hands it, and the one draw loop.

A source is chosen by ``rollout.mode`` from :data:`ROLLOUT_SOURCES`, once, at start-up; its class inherits the
mode's facts (its staleness bound, what it refuses) from the recipe's ``recipe/rollout_modes.py``, which
the recipe's checks read without this package. The driver hands each
call the weights it should generate with (:class:`Weights`: a version and the HF-named buckets to stream);
a source never reaches into the actor for them. Every mode fills a batch with the same loop,
:func:`draw_until_full`: draw ``rollout.prompts_per_step`` prompts, keep the groups that count (DAPO's
dynamic sampling: mixed accuracy), until the batch is full or ``algorithm.max_draws`` draws were made.
"""
from __future__ import annotations

import contextlib

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

import torch

from megatron_credit.registry import Registry
from megatron_credit.rollout.types import SamplingParams

if TYPE_CHECKING:
    from megatron_credit.batch.train_batch import TrainBatch
    from megatron_credit.recipe.sections import RewardConfig, RolloutConfig

Bucket = list[tuple[str, torch.Tensor]]
"""One HF-named weight bucket: ``(name, tensor)`` pairs of whole layers."""

VERIFIER_COUNTS = ("verifier/items", "verifier/timeouts", "verifier/errors", "verifier/restarts", "verifier/seconds")
"""The verifier workers' counts logged per iteration (``ScoredBatch.metrics`` of every draw, summed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weights:
    """The policy a source generates with, handed over by the driver.

    >>> w = Weights(version=3, buckets=lambda: iter([[("a", torch.zeros(2))]]))
    >>> w.version, [name for bucket in w.buckets() for name, _ in bucket]
    (3, ['a'])
    """

    version: int
    """The RL iterations these weights completed (iteration ``k`` trains version ``k - 1``)."""
    buckets: Callable[[], Iterable[Bucket]]
    """Streams the HF-named buckets; every trainer rank iterates it (the TP / PP gathers are collectives)."""


class RolloutSource(Protocol):
    """Where the trainer's batches come from. A mode is a class registered in :data:`ROLLOUT_SOURCES` under
    its ``rollout.mode`` name, a subclass of that mode's facts (``ROLLOUT_MODES`` of
    ``recipe/rollout_modes.py``: the staleness bound, the recipe's checks); an instance serves one run
    (the methods)."""

    @classmethod
    def build(cls, inputs: SourceInputs) -> RolloutSource:
        """The source of a run (every rank builds one)."""

    def next(self, iteration: int, *, weights: Weights) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's :class:`TrainBatch` of ``iteration`` (each row tagged with the ``policy_version``
        that generated it) and the rollout's metrics; ``weights`` are those of ``iteration - 1``."""

    def validate(self, iteration: int, *, weights: Weights) -> dict[str, float]:
        """Validation metrics (``val/*``) of ``weights`` (those of ``iteration``)."""

    def close(self) -> None:
        """Release the engines and worker processes."""


ROLLOUT_SOURCES: Registry[type] = Registry("rollout.mode")
"""``rollout.mode`` -> the :class:`RolloutSource` class of that mode (one file each in this package), under
the names of ``recipe.rollout_modes.ROLLOUT_MODES``."""



class Offload(Protocol):
    """The trainer's memory around a generation phase (``trainer.offload.GenerationOffload`` is the trainer's):
    ``offload`` gives the engines the GPU, ``restore`` takes it back."""

    def offload(self) -> None: ...

    def restore(self) -> None: ...

@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceInputs:
    """What the driver gives a source at start-up (``RolloutSource.build``): the recipe's sections and
    the run's data, the trainer's device and groups, never the actor itself."""

    recipe: Any
    """The run's recipe (a source reads its ``rollout``, ``reward``, ``model``, ``data`` sections, the
    seed, ``algorithm.max_draws`` / ``dynamic_sampling`` and ``train.val_*``)."""
    hf_config: Any
    """The model's HF config (the engine's architecture)."""
    tokenizer: Any
    prompts: Any
    """The job's training prompt stream (``data.prompts``)."""
    val_prompts: Any
    """The held-out prompts, or None without validation."""
    device: torch.device
    """This rank's device (collectives move their tensors through it)."""
    dp_group: Any
    """This rank's data-parallel process group."""
    dp_of_rank: Sequence[int]
    """The data-parallel rank of every global rank."""
    local_rank: int
    """This rank's device index on its node."""
    node_ranks: int
    """The ranks on each node (rank 0's node holds ``0 .. node_ranks - 1``)."""
    offload: Offload
    """What the trainer gives up while colocated engines generate (``trainer.offload.GenerationOffload``)."""
    log: Callable[..., None] = print


def sampling_params(rollout: RolloutConfig, stop_ids: tuple[int, ...], *, n: int, seed: int) -> SamplingParams:
    """The engine's sampling parameters of one draw: the recipe's ``rollout`` section, ``n`` per prompt."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                          max_new_tokens=rollout.max_response_len, stop_token_ids=stop_ids, n=n, seed=seed)


def group_counts(correct: torch.Tensor, *, dynamic_sampling: bool) -> bool:
    """Whether a group goes into the batch: always, or (DAPO's dynamic sampling) when its verdicts differ.

    >>> group_counts(torch.tensor([True, False]), dynamic_sampling=True)
    True
    >>> group_counts(torch.tensor([True, True]), dynamic_sampling=True), group_counts(torch.tensor([True, True]), dynamic_sampling=False)
    (False, True)
    """
    return bool(correct.any() & ~correct.all()) or not dynamic_sampling


T = TypeVar("T")


def draw_until_full(draw: Callable[[int], list[T]], *, count: int, max_draws: int) -> tuple[list[T], int]:
    """The one draw loop: ``draw(d)`` for ``d = 0, 1, ...`` returns the groups of draw ``d`` that count,
    until ``count`` are kept or ``max_draws`` draws were made. Returns every group kept (possibly more than
    ``count``: the last draw's surplus) and the number of draws.

    >>> draw_until_full(lambda d: ["x"] * d, count=3, max_draws=10)
    (['x', 'x', 'x'], 3)
    >>> draw_until_full(lambda d: [], count=3, max_draws=2)
    ([], 2)
    """
    kept: list[T] = []
    draws = 0
    while len(kept) < count and draws < max_draws:
        kept += draw(draws)
        draws += 1
    return kept, draws


def check_full(kept: int, *, count: int, max_draws: int, env_failed: tuple[int, int, str] = (0, 0, "")) -> None:
    """The recipe's to fix when dynamic sampling kept fewer than ``count`` groups: one error line. When the
    environment failed on every trajectory of the draws (``env_failed``: :func:`env_failures` summed over the
    engines), that is the line: every trajectory was then scored by the abort rule, so no group could have
    mixed accuracy, and more draws would not help.

    >>> check_full(0, count=2, max_draws=3, env_failed=(12, 12, "environment step raised KeyError: 'x'"))
    Traceback (most recent call last):
    ValueError: dynamic sampling kept no group: the environment failed on every trajectory of algorithm.max_draws=3 draws (12, ended by the abort rule and scored as wrong): environment step raised KeyError: 'x'; fix the environment
    """
    if kept >= count:
        return
    aborted, trajectories, why = env_failed
    if trajectories and aborted == trajectories:
        raise ValueError(
            f"dynamic sampling kept no group: the environment failed on every trajectory of "
            f"algorithm.max_draws={max_draws} draws ({trajectories}, ended by the abort rule and scored as wrong): "
            f"{why or 'no reason reached this rank'}; fix the environment")
    raise ValueError(
        f"dynamic sampling: fewer than rollout.prompts_per_step = {count} groups with mixed accuracy "
        f"after algorithm.max_draws={max_draws} draws ({kept} kept); raise algorithm.max_draws, "
        "or turn algorithm.dynamic_sampling off")


def env_failures(groups: Iterable[tuple[Sequence[Any], Any, Any]]) -> tuple[int, int, str]:
    """Of drawn groups ``(samples, rewards, correct)``: the trajectories the environment failed on (ended by
    the abort rule), the trajectories, and the first failure's one-line reason ("" when none). Single-turn
    samples are no trajectories."""
    aborted = trajectories = 0
    why = ""
    for samples, _, _ in groups:
        for s in samples:
            if s.episode is None:
                continue
            trajectories += 1
            if s.episode.aborted:
                aborted += 1
                why = why or s.error
    return aborted, trajectories, why


def counted(buckets: Iterable[Bucket], sizes: list[int]) -> Iterator[Bucket]:
    """``buckets`` unchanged, appending each one's bytes to ``sizes`` as it passes (``sync/bytes``)."""
    for bucket in buckets:
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        yield bucket


def generate_and_score(engine, verifier_workers, tokenizer, records, params: SamplingParams, *, rollout: RolloutConfig,
                       reward: RewardConfig, first_group: int, scoring=contextlib.nullcontext):
    """Sample ``params.n`` responses to each prompt record and score them: ``(RolloutBatch, shaped rewards,
    verdicts, the verifier workers' counts)``; prompt ``i`` of ``records`` is prompt ``first_group + i`` of the draw
    (its samples' seeds). The scoring runs inside ``scoring()`` (a rollout pool beats there: the engine's
    steps beat while it generates, and the verifier workers' own timeouts bound the scoring)."""
    from megatron_credit.rewards.shaping import ShapingConfig
    from megatron_credit.rollout.episode_scores import score_samples
    from megatron_credit.rollout.multi_turn import generate

    n = params.n
    batch = generate(engine, [list(rec.prompt_ids) for rec in records], params,
                     group_ids=range(first_group, first_group + len(records)), records=records)
    with scoring():
        rec_of = [records[i // n] for i in range(len(batch.samples))]
        scored = score_samples(tokenizer, batch.samples, ground_truths=[r.ground_truth for r in rec_of],
                               data_sources=[r.data_source for r in rec_of], workers=verifier_workers,
                               shaping=ShapingConfig(max_response_len=rollout.max_response_len,
                                                     overlong_buffer_len=reward.overlong_buffer_len,
                                                     overlong_penalty_factor=reward.overlong_penalty_factor))
    counts = {k: float(v) for k, v in scored.verified.metrics.items() if k in VERIFIER_COUNTS}
    return batch, scored.rewards, scored.correct, counts


def draw_share(engine, verifier_workers, tokenizer, records, mine: range, params: SamplingParams, *,
               rollout: RolloutConfig, reward: RewardConfig, dynamic_sampling: bool, scoring=contextlib.nullcontext):
    """One engine's share of a draw, as ``sync`` and the rollout pool both make it: prompts ``mine`` of the
    draw's ``records`` sampled (``params.n`` each, seeded by their index in the draw) and scored. Returns
    ``(groups, counts, verifier counts)``: ``groups[p] = (samples, rewards, correct)`` and ``counts[p]``
    (whether group ``p`` counts: :func:`group_counts`) for each ``p`` in ``mine``, and the verifier workers'
    counts of the share (:data:`VERIFIER_COUNTS`); all empty when ``mine`` is."""
    if not len(mine):
        return {}, {}, {}
    batch, rewards, correct, verifier_counts = generate_and_score(
        engine, verifier_workers, tokenizer, [records[i] for i in mine], params, rollout=rollout, reward=reward,
        first_group=mine.start, scoring=scoring)
    n, groups, counts = params.n, {}, {}
    for j, p in enumerate(mine):
        sl = slice(j * n, (j + 1) * n)
        groups[p] = (batch.samples[sl], rewards[sl], correct[sl])
        counts[p] = group_counts(correct[sl], dynamic_sampling=dynamic_sampling)
    return groups, counts, verifier_counts


def build_verifier_workers(reward: RewardConfig):
    """The engine leader's verifier workers (None with ``reward.num_workers: 0``: scored in process)."""
    if reward.num_workers == 0:
        return None
    from megatron_credit.rewards.verifier_workers import VerifierWorkers, VerifierWorkersConfig

    return VerifierWorkers(VerifierWorkersConfig(num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                                                 batch_timeout_s=reward.batch_timeout_s))
