"""Scoring finished samples, in one call (:func:`score_samples`): the text the verifier grades (a
trajectory's last turn), the length the shaping reads (the policy's tokens), the verifier and the shaping
(``rewards/compute.py``), then the returns and verdicts with the turn rewards and the abort rule; and
whether the first turn was right (docs/multi_turn.md)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron_credit.rewards.compute import ScoredBatch, score_responses
from megatron_credit.rewards.shaping import ShapingConfig
from megatron_credit.rollout.types import Episode, FinishStatus, RolloutSample  # noqa: F401  (doctests)

ABORTED_SCORE = -1.0
"""The score of a trajectory whose environment failed: that of a wrong answer (``rewards.base.incorrect``)."""


@dataclasses.dataclass(frozen=True)
class ScoredSamples:
    """What :func:`score_samples` gives for ``B`` samples."""

    rewards: torch.Tensor
    """``[B]`` float32: the returns advantages are computed from (verifier + shaping, + turn rewards)."""
    correct: torch.Tensor
    """``[B]`` bool: the verdicts (an aborted trajectory is incorrect)."""
    lengths: list[int]
    """The lengths the shaping read (:func:`scored_length`)."""
    verified: ScoredBatch
    """The verifier's own result before the episodes' rules: its records (extracted answers) and metrics."""


def score_samples(tokenizer, samples: Sequence[RolloutSample], *, ground_truths: Sequence[str],
                  data_sources: Sequence[str], shaping: ShapingConfig, workers=None) -> ScoredSamples:
    """Score ``samples``: each one's :func:`scored_text` graded by the verifier its data source names (in
    ``workers``, the killable verifier processes, or in this process when None: trusted inputs only),
    shaped by its :func:`scored_length`, then the episodes' turn rewards and abort rule
    (:func:`episode_rewards`)."""
    texts = [scored_text(tokenizer, s) for s in samples]
    lengths = [scored_length(s) for s in samples]
    verified = score_responses(workers, responses=texts, ground_truths=ground_truths, data_sources=data_sources,
                               response_lens=torch.tensor(lengths, dtype=torch.long), shaping=shaping)
    rewards, correct = episode_rewards(samples, verified.rewards, verified.correct)
    return ScoredSamples(rewards=rewards, correct=correct, lengths=lengths, verified=verified)


def scored_text(tokenizer, sample: RolloutSample) -> str:
    """The text the verifier grades: the response, or a trajectory's last turn (the model's final answer;
    the tool's output before it is not the model's answer), without special tokens: a response that stops
    ends in the tokenizer's EOS (``<|im_end|>`` for a Qwen chat model), which a ``transformers`` tokenizer
    decodes as text by default, and DAPO's verifier would read ``Answer: 42<|im_end|>`` as the answer
    ``42<|im_end|>``."""
    if sample.turn_ids is None or not len(sample.response_ids):
        return tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    last = int(sample.turn_ids[-1])
    keep = (sample.turn_ids == last) & sample.action_mask
    ids = [i for i, k in zip(sample.response_ids, keep.tolist()) if k]
    return tokenizer.decode(ids, skip_special_tokens=True)


def scored_length(sample: RolloutSample) -> int:
    """The response length the reward's shaping reads (the overlong penalty): the policy's tokens of a
    trajectory, every token of a single-turn response."""
    return len(sample.response_ids) if sample.action_mask is None else int(sample.action_mask.sum())


def episode_rewards(samples: Sequence[RolloutSample], rewards: torch.Tensor,
                    correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trajectories' returns and verdicts from the verifier's ``rewards`` / ``correct``: the turn rewards
    are added; a trajectory whose environment failed is scored by the abort rule (incorrect, the score of a
    wrong answer, :data:`ABORTED_SCORE`, plus the turn rewards earned before). Single-turn samples are left
    as they are.

    >>> s = RolloutSample(prompt_ids=[1], response_ids=[2], logprobs=torch.zeros(1), status=FinishStatus.STOPPED,
    ...                   group_id=0, sample_index=0, logprobs_mode="raw", action_mask=torch.ones(1, dtype=torch.bool),
    ...                   turn_ids=torch.zeros(1, dtype=torch.int16), episode=Episode(turn_rewards=(0.5,), env_errors=1))
    >>> r, c = episode_rewards([s], torch.tensor([1.0]), torch.tensor([True]))
    >>> r.tolist(), c.tolist()
    ([-0.5], [False])
    """
    rewards, correct = rewards.clone().float(), correct.clone().bool()
    for i, s in enumerate(samples):
        ep = s.episode
        if ep is None:
            continue
        if ep.aborted:
            rewards[i], correct[i] = ABORTED_SCORE, False
        rewards[i] += float(sum(ep.turn_rewards))
    return rewards, correct


def first_turn_correct(samples: Sequence[RolloutSample], correct: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the trajectories that are correct and played one model turn: with the feedback
    environment (a correct attempt ends the episode) the ones whose first attempt was right, with the
    calculator the ones answered without a call. ``correct``: the trajectories' final verdicts
    (:func:`episode_rewards`); a single-turn sample counts as its verdict.

    >>> ep = lambda k: RolloutSample(prompt_ids=[1], response_ids=[2], logprobs=torch.zeros(1), group_id=0,
    ...     sample_index=0, status=FinishStatus.STOPPED, logprobs_mode="raw", episode=Episode(turn_rewards=(0.0,) * k))
    >>> first_turn_correct([ep(1), ep(2), ep(1)], torch.tensor([True, True, False])).tolist()
    [True, False, False]
    """
    one = torch.tensor([s.episode is None or s.episode.turns == 1 for s in samples], dtype=torch.bool)
    return correct.bool().cpu() & one
