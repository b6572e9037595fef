"""Engine placement, prompt split, group routing and draw seeds (``rollout.placement``): pure functions."""
from __future__ import annotations

import itertools

import pytest

from megatron_credit.rollout.placement import EnginePlacement, dp_rank_of_group, draw_seed, engine_of_prompt, split


@pytest.mark.parametrize("world,local,tp", [(1, 1, 1), (4, 4, 1), (4, 4, 2), (8, 4, 2), (32, 8, 8), (16, 8, 4)])
def test_every_gpu_belongs_to_exactly_one_engine_of_its_node(world, local, tp):
    placement = EnginePlacement(world_size=world, local_world_size=local, rollout_tp=tp)
    assert placement.num_engines == world // tp
    owners = {}
    for rank in range(world):
        node, local_rank = divmod(rank, local)  # torchrun numbers ranks node by node
        gpus = placement.gpus(rank=rank, local_rank=local_rank)
        assert len(gpus) == tp and list(gpus) == list(range(gpus[0], gpus[0] + tp))  # contiguous
        assert 0 <= gpus[0] and gpus[-1] < local and local_rank in gpus
        engine = placement.engine_of(rank)
        assert placement.is_leader(rank) == (rank == placement.leader(engine))
        for g in gpus:
            assert owners.setdefault((node, g), engine) == engine  # no GPU is shared by two engines
    assert len(owners) == world  # and none is left out


def test_a_rollout_tp_that_splits_a_node_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the GPUs of a node \(8\)"):
        EnginePlacement(world_size=16, local_world_size=8, rollout_tp=3)
    with pytest.raises(ValueError, match="must be >= 1"):
        EnginePlacement(world_size=4, local_world_size=4, rollout_tp=0)


@pytest.mark.parametrize("n,parts", list(itertools.product([0, 1, 5, 8, 17], [1, 2, 3, 4, 8])))
def test_split_is_a_contiguous_partition_sized_within_one(n, parts):
    ranges = split(n, parts)
    assert [i for r in ranges for i in r] == list(range(n))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    for i in range(n):
        assert i in ranges[engine_of_prompt(i, num_prompts=n, num_engines=parts)]


def test_groups_go_to_data_parallel_ranks_in_order():
    assert [dp_rank_of_group(k, groups=8, dp_size=4) for k in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dp_rank_of_group(k, groups=8, dp_size=1) for k in range(8)] == [0] * 8


def test_draw_seeds_depend_on_the_draw_only():
    seeds = {draw_seed(1234, it, d) for it in range(1, 20) for d in range(4)} | {draw_seed(1234, -1)}
    assert len(seeds) == 19 * 4 + 1 and all(0 <= s < 2 ** 56 for s in seeds)
    assert draw_seed(1234, 3, 0) != draw_seed(1235, 3, 0)
