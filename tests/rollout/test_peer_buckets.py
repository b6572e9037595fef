"""The ranks of one engine's GPUs each hand the engine's leader their own copy of every weight bucket
(``rollout.weight_sync.PeerBuckets``; on CUDA: IPC from the colocated rank), on a gloo world of 3."""
from __future__ import annotations

import pytest

from megatron_credit.rollout.vllm_worker import select_device_bucket
from tests.support.distributed_harness import module_pool

pytestmark = pytest.mark.dist

pool = module_pool(3)


def _sync(n_buckets: int):
    """Rank 0 leads an engine over ranks 0 and 1; rank 2 has an engine of its own (no peers). Returns what
    the leader received per bucket, and on the follower whether each staged copy lived until the leader
    was done with it."""
    import weakref

    import torch
    import torch.distributed as dist

    from megatron_credit.rollout.weight_sync import PeerBuckets

    rank = dist.get_rank()
    log: list = []

    def stage(bucket, device):
        tensors = [(name, t.to(device).clone() + rank) for name, t in bucket]
        log.append(weakref.ref(tensors[0][1]))
        return tensors, {"rank": rank, "names": [n for n, _ in tensors],
                         "sum": float(sum(t.sum() for _, t in tensors))}

    groups = [dist.new_group([0, 1]), dist.new_group([2])]  # every rank makes every group, in order
    buckets = [[(f"model.layers.{i}.w", torch.full((2,), float(i)))] for i in range(n_buckets)]
    if rank == 2:
        return None
    peers = PeerBuckets(groups[0], 0, stage)
    if rank == 1:
        alive = []

        def watched(stream):
            for b in stream:
                if log:
                    alive.append(log[-1]() is None)  # the previous bucket's copy is gone once done
                yield b
        peers.follow(watched(buckets), torch.device("cpu"))
        return alive
    got = []
    for bucket in buckets:  # what the engine's update_weights does with ``peers``
        _, handle = stage(bucket, torch.device("cpu"))
        got.append(peers.gather(handle))
        peers.done()
    return got


def test_the_leader_gets_every_ranks_copy_of_every_bucket_in_order(pool):
    leader, follower, alone = pool.run(_sync, 3)
    assert alone is None
    assert [[h["rank"] for h in per_bucket] for per_bucket in leader] == [[0, 1]] * 3
    assert [[h["names"] for h in b] for b in leader] == [[[f"model.layers.{i}.w"]] * 2 for i in range(3)]
    assert [[h["sum"] for h in b] for b in leader] == [[2.0 * i, 2.0 * i + 2.0] for i in range(3)]
    assert follower == [True, True]  # each staged copy was freed only after the leader's done()


def test_a_worker_opens_the_copy_on_its_own_gpu():
    a, b = {"device_uuid": "GPU-a", "tensors": []}, {"device_uuid": "GPU-b", "tensors": []}
    both = {"by_device": {"GPU-a": a, "GPU-b": b}}
    assert select_device_bucket(both, own_uuid="GPU-b") is b and select_device_bucket(a, own_uuid="GPU-z") is a
    with pytest.raises(RuntimeError, match="no trainer rank staged this weight bucket on the worker's GPU GPU-c"):
        select_device_bucket(both, own_uuid="GPU-c")
