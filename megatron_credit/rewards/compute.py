"""One call from decoded responses to shaped reward tensors: verifier (in the verifier workers) + shaping.

>>> out = score_responses(
...     None, responses=["Answer: 4", "Answer: 5"], ground_truths=["4", "4"],
...     data_sources=["math_dapo", "math_dapo"], response_lens=torch.tensor([3, 9]),
...     shaping=ShapingConfig(max_response_len=10, overlong_buffer_len=2),
... )
>>> out.scores, out.correct, out.rewards
(tensor([ 1., -1.]), tensor([ True, False]), tensor([ 1.0000, -1.5000]))
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron_credit.rewards.base import RewardRecord
from megatron_credit.rewards.math import compute_score_for_source
from megatron_credit.rewards.verifier_workers import RewardItem, VerifierWorkers
from megatron_credit.rewards.shaping import ShapingConfig, shape_rewards


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoredBatch:
    """Rewards of B responses."""

    rewards: torch.Tensor
    """``[B]`` float32: verifier score + shaping penalties; what advantages are computed from."""
    scores: torch.Tensor
    """``[B]`` float32: verifier score alone (±1)."""
    correct: torch.Tensor
    """``[B]`` bool: accuracy; what dynamic sampling groups on (shaping never changes it)."""
    records: list[RewardRecord]
    """Per-response verifier records (extracted answers, status)."""
    metrics: dict[str, torch.Tensor]
    """Detached scalar tensors: the verifier workers' counts, shaping components, accuracy."""


def score_responses(
    workers: VerifierWorkers | None, *, responses: Sequence[str], ground_truths: Sequence[str],
    data_sources: Sequence[str], response_lens: torch.Tensor, shaping: ShapingConfig,
) -> ScoredBatch:
    """Verify ``B`` responses (in ``workers``, or in-process when ``workers`` is None: trusted inputs only)
    and shape them. ``response_lens: [B]`` counts response tokens."""
    items = [
        RewardItem(response=r, ground_truth=g, data_source=s)
        for r, g, s in zip(responses, ground_truths, data_sources, strict=True)
    ]
    if workers is not None:
        records, worker_metrics = workers.score_batch(items)
    else:
        records = [
            compute_score_for_source(i.response, i.ground_truth, data_source=i.data_source) for i in items
        ]
        worker_metrics = {}
    scores = torch.tensor([r.score for r in records], dtype=torch.float32)
    correct = torch.tensor([r.correct for r in records], dtype=torch.bool)
    rewards, shaping_metrics = shape_rewards(scores, correct, response_lens, list(responses), config=shaping)
    metrics = {k: torch.tensor(v) for k, v in worker_metrics.items()}
    metrics.update(shaping_metrics)
    metrics["reward/accuracy"] = correct.float().mean() if len(records) else torch.tensor(0.0)
    bad_gt = sum(r.status == "bad_ground_truth" for r in records)
    metrics["reward/bad_ground_truths"] = torch.tensor(float(bad_gt))
    metrics["reward/score_mean"] = scores.mean() if len(records) else torch.tensor(0.0)
    return ScoredBatch(rewards=rewards, scores=scores, correct=correct, records=records, metrics=metrics)
