"""A diverged run stops before it saves: skipped optimizer steps in a row, or a collapsed policy.

A step whose loss or gradient norm is not finite is skipped (``trainer/actor.py``): the parameters do not
move. A run with ``optim.lr=1e30`` skips every step, and before this guard it went on saving the
unchanged state and, with ``checkpoint.keep``, pruning the good checkpoints. A policy collapsed to the
uniform distribution (``optim.lr=1e3``: entropy ``ln V``, gradient norm 0) trains nothing either. Either
stops the run with one line (:class:`TrainingDiverged`, a user error: exit 2) before the iteration's
checkpoint is written, so every checkpoint on disk is one from before the divergence.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

COLLAPSE_ITERATIONS = 2
"""Iterations in a row at uniform entropy with zero gradient that count as a collapsed policy."""
COLLAPSE_ENTROPY_FRACTION = 0.98
"""Entropy at or above this fraction of ``ln(vocab_size)`` counts as uniform."""


class TrainingDiverged(ValueError):
    """The run diverged; the message names the evidence and the recipe field to change."""


@dataclasses.dataclass
class DivergenceGuard:
    """Watches each iteration's metrics (``actor/skipped_steps``, ``actor/entropy``, ``actor/grad_norm``).

    >>> g = DivergenceGuard(max_skipped_steps=4, steps_per_iteration=2, vocab_size=64)
    >>> g.check(1, {"actor/skipped_steps": 2.0}) is None
    True
    >>> g.check(2, {"actor/skipped_steps": 2.0})[:40]
    'diverged: 4 optimizer steps in a row wer'
    """

    max_skipped_steps: int
    """``train.max_skipped_steps`` (0: never stop for skipped steps)."""
    steps_per_iteration: int
    """Optimizer steps of one iteration (``train.num_minibatches * train.epochs``)."""
    vocab_size: int
    skipped_in_a_row: int = 0
    collapsed_in_a_row: int = 0
    seen_non_uniform: bool = False
    """A policy that was never away from uniform (a random initialisation) has not collapsed."""

    def check(self, step: int, metrics: dict[str, float]) -> Optional[str]:
        """The stop message after iteration ``step``, or None to go on."""
        skipped = int(metrics.get("actor/skipped_steps", 0.0))
        # Within an iteration the order of skipped steps is not known: a partly skipped one ends a streak.
        self.skipped_in_a_row = self.skipped_in_a_row + skipped if skipped >= self.steps_per_iteration else 0
        if self.max_skipped_steps and self.skipped_in_a_row >= self.max_skipped_steps:
            return (f"diverged: {self.skipped_in_a_row} optimizer steps in a row were skipped (non-finite loss or "
                    f"gradient norm) up to iteration {step}; stopped before saving it, the checkpoints on disk are "
                    f"from before (lower optim.lr; train.max_skipped_steps={self.max_skipped_steps})")
        entropy, norm = metrics.get("actor/entropy"), metrics.get("actor/grad_norm")
        uniform = entropy is not None and (not math.isfinite(entropy)
                                           or entropy >= COLLAPSE_ENTROPY_FRACTION * math.log(self.vocab_size))
        collapsed = uniform and self.seen_non_uniform and norm is not None and norm == 0.0
        self.seen_non_uniform = self.seen_non_uniform or (entropy is not None and not uniform)
        self.collapsed_in_a_row = self.collapsed_in_a_row + 1 if collapsed else 0
        if self.collapsed_in_a_row >= COLLAPSE_ITERATIONS:
            return (f"diverged: the policy collapsed to uniform (entropy {entropy:.3f} of at most "
                    f"ln({self.vocab_size}) = {math.log(self.vocab_size):.3f}, gradient norm 0) for "
                    f"{self.collapsed_in_a_row} iterations up to iteration {step}; stopped before saving it "
                    "(lower optim.lr)")
        return None


def stop_if_any_rank_diverged(message: Optional[str], *, device: Optional[torch.device] = None) -> None:
    """Collective: raise :class:`TrainingDiverged` on every rank when any rank's guard fired (ranks
    whose metrics are partial, e.g. middle pipeline stages, then stop with the others)."""
    flag = torch.tensor([0.0 if message is None else 1.0], device=device)  # device: the collectives' (NCCL: CUDA)
    if dist.is_initialized():
        dist.all_reduce(flag)
    if float(flag) > 0:
        raise TrainingDiverged(message or "diverged on another rank (see rank 0's message)")
