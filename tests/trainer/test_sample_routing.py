"""How scored groups reach the ranks that train them (``sources/routing.py`` with ``rollout/wire.py``):
each group crosses a process boundary once, as bytes of tensors, to the first rank of its data-parallel
replica, which broadcasts the replica's groups to its other ranks. Checked on gloo at world 4 in three
layouts (DP 4; DP 2 with replicas of two ranks, as TP 2; DP 1, one replica of four ranks, as a 32B job at
DP 1), with groups held by several engine leaders: every rank gets exactly its replica's groups, in order,
equal field by field (routing included) to what the engines held; the messages carry each group once
(``transfer/sample_bytes`` within 1.1x the samples' payload of ids and log-probs); the broadcast moves the
replica's share to each other rank once. The wire format itself (every field, FAILED samples' errors,
truncated messages) is ``tests/rollout/test_wire.py``."""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool

pytestmark = pytest.mark.dist

pool4 = module_pool(4)
GROUPS, N = 8, 2


def _group(k: int):
    from megatron_credit.rollout.types import FinishStatus, RolloutSample

    g = torch.Generator().manual_seed(k)
    samples = []
    for j in range(N):
        p, r = 16 + k, 64 + 8 * j
        samples.append(RolloutSample(
            prompt_ids=torch.randint(0, 50000, (p,), generator=g).tolist(),
            response_ids=torch.randint(0, 50000, (r,), generator=g).tolist(),
            logprobs=-torch.rand(r, generator=g), status=FinishStatus.STOPPED, group_id=k, sample_index=j,
            logprobs_mode="raw", routed_experts=torch.randint(0, 8, (p + r, 2, 2), generator=g, dtype=torch.int16)
            if k % 2 else None))
    return samples, torch.tensor([1.0, -1.0]), torch.tensor([True, False])


def _route(dp_of_rank: list[int]):
    """This rank's routed groups and the transfer metrics; engine leaders: ranks 0 and 2 hold alternate groups."""
    import torch.distributed as dist

    from megatron_credit.rollout.placement import dp_rank_of_group
    from megatron_credit.sources.routing import RolloutSourceBase

    r = RolloutSourceBase()
    r.dp_of_rank, r.dp_size, r.device = dp_of_rank, max(dp_of_rank) + 1, torch.device("cpu")
    rank = dist.get_rank()
    kept = [(0, k) for k in range(GROUPS)]
    held = {key: _group(key[1]) for key in kept if rank in (0, 2) and key[1] % 2 == rank // 2}
    got = r._route(kept, held)
    want = [k for k in range(GROUPS) if dp_rank_of_group(k, groups=GROUPS, dp_size=r.dp_size) == dp_of_rank[rank]]
    return got, want, r._transfer_metrics()


def _same(a, b) -> bool:
    (sa, ra, ca), (sb, rb, cb) = a, b
    if not (torch.equal(ra, rb) and torch.equal(ca, cb)) or len(sa) != len(sb):
        return False
    for x, y in zip(sa, sb):
        if (x.prompt_ids, x.response_ids, x.status, x.group_id, x.sample_index) != \
                (y.prompt_ids, y.response_ids, y.status, y.group_id, y.sample_index):
            return False
        if not torch.equal(x.logprobs, y.logprobs):
            return False
        if (x.routed_experts is None) != (y.routed_experts is None):
            return False
        if x.routed_experts is not None and not torch.equal(x.routed_experts, y.routed_experts):
            return False
    return True


@pytest.mark.parametrize("dp_of_rank, replica", [([0, 1, 2, 3], 1), ([0, 0, 1, 1], 2), ([0, 0, 0, 0], 4)],
                         ids=["dp4", "dp2_replicas_of_2", "dp1_replica_of_4"])
def test_each_group_reaches_its_replica_once_as_tensors(pool4, dp_of_rank, replica):
    results = pool4.run(_route, dp_of_rank)
    for rank, (got, want, metrics) in enumerate(results):
        assert len(got) == len(want)
        assert all(_same(g, _group(k)) for g, k in zip(got, want)), rank
        sent, payload = metrics["transfer/sample_bytes"], metrics["transfer/sample_payload_bytes"]
        assert payload == sum(5 * N + sum(4 * (len(s.prompt_ids) + 2 * len(s.response_ids))
                                          + (0 if s.routed_experts is None else 2 * s.routed_experts.numel())
                                          for s in _group(k)[0]) for k in range(GROUPS))
        assert payload < sent <= 1.1 * payload  # every group once, with its header
        # each replica's head sends its share to the replica's other ranks once
        assert metrics["transfer/sample_broadcast_bytes"] == pytest.approx(sent * (replica - 1), rel=0.05)
