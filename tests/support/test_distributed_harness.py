import pytest
import torch

from tests.support.distributed_harness import module_pool


pytestmark = pytest.mark.dist


pool = module_pool(2)


def _allreduce_rank_plus(x):
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom")
    return 0


def test_pool_runs_collectives_in_rank_order(pool):
    assert pool.run(_allreduce_rank_plus, 1) == [(0, 3.0), (1, 3.0)]
    assert pool.run(_allreduce_rank_plus, 2) == [(0, 5.0), (1, 5.0)]


def test_pool_reports_rank_traceback_and_restarts(pool):
    with pytest.raises(RuntimeError, match="(?s)rank 1.*ValueError: boom"):
        pool.run(_fail_on_rank1)
    assert pool.run(_allreduce_rank_plus, 0) == [(0, 1.0), (1, 1.0)]
