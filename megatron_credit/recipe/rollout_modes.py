"""The rollout modes' facts (``rollout.mode``): what each mode asks of the recipe, kept with the recipe.

A mode is two things. Its facts are about the recipe alone: the most versions a trained sample may lag
(its staleness bound), which ``rollout`` fields it needs, what it refuses at a world size. They live here,
in :data:`ROLLOUT_MODES`, so that a recipe is checked without importing the code that runs it. Its source
(``megatron_credit/sources/``: the engines, the rollout pool, the channels between them) serves a run; it
registers under the same name in ``megatron_credit.sources.ROLLOUT_SOURCES`` and inherits the facts
from the class here, so one class answers both. The trainer resolves the source once, at start-up.

>>> ROLLOUT_MODES.names()
['async', 'one_step_off', 'sync']
>>> ROLLOUT_MODES.get("fast")
Traceback (most recent call last):
...
ValueError: unknown rollout.mode 'fast'; valid names: ['async', 'one_step_off', 'sync']
"""
from __future__ import annotations

from megatron_credit.registry import Registry

ROLLOUT_MODES: Registry[type] = Registry("rollout.mode")
"""``rollout.mode`` -> the :class:`RolloutMode` holding that mode's facts."""


class RolloutMode:
    """A mode's facts, classmethods of the recipe's ``rollout`` section (a ``sections.RolloutConfig``); a
    source subclasses its mode."""

    interruptible = False
    """New weights are taken between draws of a batch (``async``), or between batches only."""

    @classmethod
    def staleness_bound(cls, rollout) -> int:
        """The most versions a trained sample may lag the weights that train it."""
        raise NotImplementedError

    @classmethod
    def check_section(cls, rollout) -> None:
        """Raise ``ValueError`` naming the field when the ``rollout`` section does not fit this mode."""

    @classmethod
    def recipe_problems(cls, rollout, *, world_size: int) -> list[str]:
        """One line per problem of this mode at ``world_size`` ranks (``Recipe.problems``)."""
        return []


@ROLLOUT_MODES.register("sync")
class Sync(RolloutMode):
    """The engines share the trainer's GPUs; generate, then train: staleness 0."""

    @classmethod
    def staleness_bound(cls, rollout) -> int:
        return 0

    @classmethod
    def check_section(cls, rollout) -> None:
        if rollout.ranks:
            raise ValueError(f"rollout.ranks={rollout.ranks}: sync generates on the trainer's own ranks; a rollout pool "
                             "is for rollout.mode=one_step_off or async")

    @classmethod
    def recipe_problems(cls, rollout, *, world_size: int) -> list[str]:
        if world_size % rollout.tensor_parallel_size:
            return [f"rollout.engine_options.tensor_parallel_size={rollout.tensor_parallel_size} must divide the world "
                    f"size {world_size} (world size / rollout TP engines, each on GPUs of its own)"]
        return []


class Pool(RolloutMode):
    """A rollout pool (the last ``rollout.ranks`` of the launch) generates while the trainer trains."""

    @classmethod
    def staleness_bound(cls, rollout) -> int:
        return rollout.max_staleness

    @classmethod
    def check_section(cls, rollout) -> None:
        if rollout.ranks < 1:
            raise ValueError(f"rollout.mode={rollout.mode} generates on a rollout pool: set rollout.ranks >= 1 (the "
                             "last ranks of the launch; torchrun --nproc-per-node counts them, and pretrain_rl.py "
                             "without torchrun starts them itself)")

    @classmethod
    def recipe_problems(cls, rollout, *, world_size: int) -> list[str]:
        out = []
        if rollout.ranks % rollout.tensor_parallel_size:
            out.append(f"rollout.ranks={rollout.ranks} must be a multiple of rollout.engine_options.tensor_parallel_size="
                       f"{rollout.tensor_parallel_size}: each engine takes that many ranks")
        if rollout.on_update == "partial" and rollout.engine != "hf":
            out.append(f"rollout.on_update=partial: the {rollout.engine} engine cannot take new weights in the middle "
                       "of a draw; use rollout.on_update=finish")
        return out


@ROLLOUT_MODES.register("one_step_off")
class OneStepOff(Pool):
    """Iteration k + 1's batch is generated with the weights of k - 1 while k trains: staleness exactly 1."""

    @classmethod
    def staleness_bound(cls, rollout) -> int:
        return 1

    @classmethod
    def check_section(cls, rollout) -> None:
        super().check_section(rollout)
        if rollout.max_staleness != 1:
            raise ValueError(f"rollout.max_staleness={rollout.max_staleness}: one_step_off trains on samples exactly one "
                             "version old; use rollout.mode=async for another bound")


@ROLLOUT_MODES.register("async")
class Async(Pool):
    """Generation runs continuously, up to ``rollout.max_staleness`` versions ahead; new weights are loaded
    between draws too (``rollout.on_update``)."""

    interruptible = True
