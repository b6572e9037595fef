"""A diverged run stops before it saves: skipped optimizer steps in a row, a collapsed policy, or an
environment that fails on every trajectory (:class:`EnvironmentGuard`).

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


@dataclasses.dataclass
class EnvironmentGuard:
    """Watches a multi-turn run's environment (``env/failed_frac``, ``env/error_reasons``): its failures
    are logged once per reason per iteration, and a run whose environment failed on every trajectory for
    ``env.max_failed_iterations`` iterations in a row stops with one line naming it (every trajectory is
    scored by the abort rule: the run learns nothing).

    >>> g = EnvironmentGuard(name="calc", max_failed_iterations=2)
    >>> m = {"env/failed_frac": 1.0, "env/errors": 8.0, "env/error_reasons": {"environment step raised E: x": 8}}
    >>> g.lines(3, m)
    ['iteration 3: env calc failed on 8 trajectories (ended by the abort rule): environment step raised E: x']
    >>> g.check(3, m) is None, g.check(4, m)[:57]
    (True, 'env calc failed on every trajectory for 2 iterations in a')
    """

    name: str
    """``env.name``."""
    max_failed_iterations: int
    """``env.max_failed_iterations`` (0: never stop)."""
    failed_in_a_row: int = 0

    def lines(self, step: int, metrics: dict) -> list[str]:
        """One log line per reason the environment failed for in iteration ``step``."""
        return [f"iteration {step}: env {self.name} failed on {count} trajectories (ended by the abort rule): {why}"
                for why, count in (metrics.get("env/error_reasons") or {}).items()]

    def check(self, step: int, metrics: dict) -> Optional[str]:
        """The stop message after iteration ``step``, or None to go on."""
        frac = metrics.get("env/failed_frac")
        self.failed_in_a_row = self.failed_in_a_row + 1 if frac is not None and frac >= 1.0 else 0
        if not self.max_failed_iterations or self.failed_in_a_row < self.max_failed_iterations:
            return None
        reasons = metrics.get("env/error_reasons") or {}
        why = next(iter(reasons), "no reason reached this rank")
        more = f" (and {len(reasons) - 1} other reasons, in the log)" if len(reasons) > 1 else ""
        return (f"env {self.name} failed on every trajectory for {self.failed_in_a_row} iterations in a row up to "
                f"iteration {step}: {why}{more}; stopped before saving it (fix the environment; "
                f"env.max_failed_iterations={self.max_failed_iterations})")


def stop_if_any_rank_diverged(message: Optional[str], *, device: Optional[torch.device] = None) -> None:
    """Collective: raise :class:`TrainingDiverged` on every rank when any rank's guard fired (ranks
    whose metrics are partial, e.g. middle pipeline stages, then stop with the others)."""
    flag = torch.tensor([0.0 if message is None else 1.0], device=device)  # device: the collectives' (NCCL: CUDA)
    if dist.is_initialized():
        dist.all_reduce(flag)
    if float(flag) > 0:
        raise TrainingDiverged(message or "diverged on another rank (see rank 0's message)")
