"""Where the rollout engines run, which prompts each one samples, which rank trains each group, and the
seeds they sample with: pure functions (no torch), shared by the trainer and the planner.

Every GPU generates. The number of engines is the world size over the rollout tensor-parallel size
(``rollout.engine_options.tensor_parallel_size``), whatever the trainer's TP / PP / CP / DP: engine ``e``
is built by rank ``e * rollout_tp`` (its *leader*) and owns the GPUs of ranks ``e * rollout_tp ..
(e + 1) * rollout_tp - 1``, contiguous local devices of one node (torchrun numbers ranks node by node, and
``distributed.initialize`` puts rank ``r`` on local device ``LOCAL_RANK``). No two engines share a GPU.

An iteration's prompts are one global list, cut into contiguous, near-equal slices, one per engine
(:func:`split`). After scoring (and dynamic sampling), the kept groups are dealt to the data-parallel ranks
in order, ``prompts_per_step / DP`` consecutive groups each (:func:`dp_rank_of_group`). Sampling seeds
depend on (run seed, iteration, draw) and, inside an engine, on the prompt's index in the draw and the
sample's index (:func:`megatron_credit.rollout.sampling.row_seed`): never on a rank or the engine count,
so 1, 2 or 4 engines sample the same responses, and a resumed or resharded run samples what the
uninterrupted run would have.

>>> placement = EnginePlacement(world_size=8, local_world_size=4, rollout_tp=2)
>>> placement.num_engines, placement.engine_of(5), placement.leader(2), placement.gpus(rank=5, local_rank=1)
(4, 2, 4, (0, 1))
>>> [list(r) for r in split(5, 2)]
[[0, 1], [2, 3, 4]]
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePlacement:
    """The engines of a job of ``world_size`` ranks, ``local_world_size`` per node, ``rollout_tp`` GPUs per
    engine. Raises ValueError when ``rollout_tp`` does not divide the ranks of a node."""

    world_size: int
    local_world_size: int
    rollout_tp: int

    def __post_init__(self) -> None:
        if self.rollout_tp < 1:
            raise ValueError(f"rollout.engine_options.tensor_parallel_size must be >= 1, got {self.rollout_tp}")
        if self.local_world_size % self.rollout_tp or self.world_size % self.rollout_tp:
            raise ValueError(
                f"rollout.engine_options.tensor_parallel_size={self.rollout_tp} must divide the GPUs of a node "
                f"({self.local_world_size}) and the world size ({self.world_size}): an engine owns contiguous "
                "GPUs of one node")

    @property
    def num_engines(self) -> int:
        return self.world_size // self.rollout_tp

    def engine_of(self, rank: int) -> int:
        """The engine whose GPUs include ``rank``'s."""
        return rank // self.rollout_tp

    def leader(self, engine: int) -> int:
        """The rank that builds and drives ``engine`` (the first of its ranks)."""
        return engine * self.rollout_tp

    def is_leader(self, rank: int) -> bool:
        return rank % self.rollout_tp == 0

    def gpus(self, *, rank: int, local_rank: int) -> tuple[int, ...]:
        """The local device indices of the engine that ``rank`` (on local device ``local_rank``) belongs to."""
        first = local_rank - rank % self.rollout_tp
        return tuple(range(first, first + self.rollout_tp))


def split(n: int, parts: int) -> list[range]:
    """``range(n)`` in ``parts`` contiguous slices whose sizes differ by at most one (later ones larger);
    a slice is empty when there are more parts than items.

    >>> [len(r) for r in split(3, 4)]
    [0, 1, 1, 1]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [range(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def engine_of_prompt(index: int, *, num_prompts: int, num_engines: int) -> int:
    """The engine of :func:`split` that samples prompt ``index`` of ``num_prompts``.

    >>> [engine_of_prompt(i, num_prompts=5, num_engines=2) for i in range(5)]
    [0, 0, 1, 1, 1]
    """
    for e, r in enumerate(split(num_prompts, num_engines)):
        if index in r:
            return e
    raise ValueError(f"prompt {index} is not one of {num_prompts}")


def dp_rank_of_group(k: int, *, groups: int, dp_size: int) -> int:
    """The data-parallel rank that trains kept group ``k`` of ``groups`` (``groups / dp_size`` consecutive
    groups per rank: the order the trainer's layout assigns).

    >>> [dp_rank_of_group(k, groups=4, dp_size=2) for k in range(4)]
    [0, 0, 1, 1]
    """
    return k // (groups // dp_size)


def draw_seed(*parts: int) -> int:
    """The sampling seed of one draw: a hash of ``(run seed, iteration, draw)`` (validation: iteration -1),
    in [0, 2^56). Engines derive each sample's generator from it, the prompt's index in the draw and the
    sample's index.

    >>> draw_seed(1, 2, 0) == draw_seed(1, 2, 0) != draw_seed(1, 2, 1)
    True
    """
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")
