"""A pool rank's ring of host chunks (``megatron_credit/sources/staging.py``) in one process: chunks allocated
once and reused by every version, at most one staged version (a newer one replaces it), the newest complete
version loaded, a receipt that waits while one version loads and another is staged, a version bucketed
unlike the first refused in one line. The same ring under a real receipt of a tiny model's buckets, against
the planner's figure: ``tests/trainer/test_rollout_pool.py``."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_credit.sources.bucket_bytes import pack
from megatron_credit.sources.staging import FREE, LOADING, RECEIVING, STAGED, StagingRing


def _receive(ring: StagingRing, version: int, buckets, stop=lambda: False):
    """What ``Bridge.receive_weights`` does with each bucket, without the process group."""
    bank = ring.begin(stop)
    if bank is None:
        return None
    got = []
    for i, bucket in enumerate(buckets):
        meta, flat = pack(bucket, torch.device("cpu"))
        ring.chunk(bank, i, flat.numel()).copy_(flat)
        got.append((meta, flat.numel()))
    ring.stage(bank, version, got)
    return bank


def _version(v: int):
    """Two buckets of 40 and 24 bytes whose values say the version."""
    return [[("model.embed_tokens.weight", torch.full((2, 5), float(v)))],
            [("model.layers.0.mlp.up_proj.weight", torch.full((3,), float(v), dtype=torch.float64))]]


def _values(buckets) -> list:
    return [t.tolist() for bucket in buckets for _, t in bucket]


def test_versions_reuse_the_chunks_and_the_newest_complete_one_is_loaded():
    ring = StagingRing(pin=False)
    assert _receive(ring, 1, _version(1)) == 0 and ring.pinned_bytes == 64 + 32  # 40 and 24 bytes, as pow2 blocks
    assert _receive(ring, 2, _version(2)) == 1 and ring.pinned_bytes == 2 * 96  # v1 staged: the second bank
    assert ring.state == [FREE, STAGED] and ring.staged_version == 2  # v1 dropped: one staged version
    with ring.take() as (version, buckets):
        assert version == 2 and ring.state == [FREE, LOADING]
        assert _receive(ring, 3, _version(3)) == 0  # received while v2 loads, into the free bank
        assert _values(buckets) == [[[2.0] * 5] * 2, [2.0] * 3]  # v2 whole: v3 went elsewhere
    assert ring.state == [STAGED, FREE] and ring.staged_version == 3
    for v in (4, 5, 6):
        _receive(ring, v, _version(v))
    with ring.take() as (version, buckets):
        assert version == 6 and _values(buckets) == [[[6.0] * 5] * 2, [6.0] * 3]
    with ring.take() as nothing:
        assert nothing is None  # loaded: nothing staged until the next version
    assert ring.pinned_bytes == 192 and [len(c) for c in ring.chunks] == [2, 2]  # six versions, no new chunk


def test_a_receipt_waits_while_one_version_loads_and_another_is_staged():
    ring = StagingRing(pin=False)
    _receive(ring, 1, _version(1))
    done = []
    with ring.take() as (version, buckets):
        _receive(ring, 2, _version(2))
        waiter = threading.Thread(target=lambda: done.append(_receive(ring, 3, _version(3))))
        waiter.start()
        time.sleep(0.15)
        assert done == [] and ring.state == [LOADING, STAGED]  # v1 loading, v2 staged: no bank for v3
        assert _values(buckets)[1] == [1.0] * 3
    waiter.join(timeout=5)
    assert done == [0] and ring.state == [STAGED, FREE] and ring.staged_version == 3


def test_a_receipt_stopped_while_waiting_or_cut_short_leaves_the_staged_version():
    ring = StagingRing(pin=False)
    _receive(ring, 1, _version(1))
    with ring.take():
        _receive(ring, 2, _version(2))
        assert _receive(ring, 3, _version(3), stop=lambda: True) is None  # the run stops: no bank taken
    bank = ring.begin(lambda: False)
    assert ring.state[bank] == RECEIVING
    ring.abandon(bank)  # a receipt cut short: its bank free, the staged version untouched
    assert ring.state == [FREE, STAGED] and ring.staged_version == 2


def test_a_version_bucketed_unlike_the_first_is_refused_in_one_line():
    ring = StagingRing(pin=False)
    _receive(ring, 1, _version(1))
    _receive(ring, 2, _version(2))
    bank = ring.begin(lambda: False)
    with pytest.raises(ValueError) as e:
        ring.chunk(bank, 0, 200)
    assert str(e.value) == ("weight bucket 0 of a version has 200 bytes, more than the 64 its host chunk took from "
                            "an earlier version: every version must be bucketed alike (the same model, the same "
                            "bucket_bytes)")
