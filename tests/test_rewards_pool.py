"""The reward process pool: order, per-item timeouts that kill and replace a worker, errors.

The hanging and raising verifiers are registered only here; workers import this module to unpickle
them (they are sent by reference).
"""
import os
import time

import pytest

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, graded, method_for_data_source
from megatron_credit.rewards.math import compute_score
from megatron_credit.rewards.pool import RewardItem, RewardPool, RewardPoolConfig


def _hang(response, ground_truth):
    if response == "hang":
        time.sleep(3600)  # a parse that never returns
    return graded(response == ground_truth, response)


def _raise(response, ground_truth):
    raise RuntimeError("verifier bug")


def _die(response, ground_truth):
    os._exit(3)  # a worker that crashes (segfault, OOM kill)


def _not_a_record(response, ground_truth):
    return 1.0


_TEST_FNS = [("test_hang", _hang), ("test_raise", _raise), ("test_die", _die), ("test_bad", _not_a_record)]
for _name, _fn in _TEST_FNS:
    if _name not in REWARD_FNS:
        REWARD_FNS.add(_name, _fn)


@pytest.fixture(scope="module")
def pool():
    # 3 s: far above a verifier call even on a loaded CI machine, far below the hang.
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=3.0, chunk_size=4)) as p:
        yield p


def _mixed_items(n):
    items = []
    for i in range(n):
        if i % 3 == 0:
            items.append(RewardItem(response=f"work\nAnswer: {i}", ground_truth=str(i if i % 2 else i + 1)))
        elif i % 3 == 1:
            response = f"\\boxed{{\\frac{{{i}}}{{2}}}}"
            items.append(RewardItem(response=response, ground_truth=str(i / 2), data_source="math"))
        else:
            items.append(RewardItem(response=f" {i}", ground_truth=str(i), data_source="synthetic_arith"))
    return items


def _in_process(item):
    method = item.method or method_for_data_source(item.data_source)
    return compute_score(item.response, item.ground_truth, method=method)


def test_pool_matches_in_process_scoring(pool):
    items = _mixed_items(41)
    records, metrics = pool.score_batch(items)
    assert records == [_in_process(it) for it in items]
    assert metrics["reward_pool/items"] == 41
    assert metrics["reward_pool/timeouts"] == 0 and metrics["reward_pool/errors"] == 0
    assert metrics["reward_pool/accuracy"] == pytest.approx(sum(r.correct for r in records) / 41)
    empty, empty_metrics = pool.score_batch([])
    assert empty == [] and empty_metrics["reward_pool/items"] == 0


def test_hanging_item_times_out_and_worker_is_replaced(pool):
    responses = ["a", "b", "hang", "a", "hang", "b", "a"]
    items = [RewardItem(response=r, ground_truth="a", method="test_hang") for r in responses]
    items += _mixed_items(10)
    pids_before = {w.proc.pid for w in pool._workers}
    t0 = time.perf_counter()
    records, metrics = pool.score_batch(items)
    elapsed = time.perf_counter() - t0
    assert metrics["reward_pool/timeouts"] == 2
    assert metrics["reward_pool/restarts"] == 2
    assert metrics["reward_pool/errors"] == 0
    # Hung items: incorrect with status "timeout"; every other item scored as in-process.
    for item, rec in zip(items, records):
        if item.response == "hang":
            assert rec == RewardRecord(score=-1.0, correct=False, extracted=None, status="timeout")
        elif item.method == "test_hang":
            assert rec == graded(item.response == "a", item.response)
        else:
            assert rec == _in_process(item)
    assert elapsed < 30.0  # two 3 s deadlines, not an hour
    assert {w.proc.pid for w in pool._workers} != pids_before
    assert all(w.proc.is_alive() for w in pool._workers)
    # The replaced workers serve the next batch.
    records, metrics = pool.score_batch(_mixed_items(6))
    assert records == [_in_process(it) for it in _mixed_items(6)] and metrics["reward_pool/timeouts"] == 0


def test_raising_dying_and_bad_verifiers_score_as_errors(pool):
    items = [
        RewardItem(response="x", ground_truth="1", method="test_raise"),
        RewardItem(response="Answer: 1", ground_truth="1"),
        RewardItem(response="x", ground_truth="1", method="test_die"),
        RewardItem(response="Answer: 2", ground_truth="1"),
        RewardItem(response="x", ground_truth="1", method="test_bad"),
        RewardItem(response="Answer: 3", ground_truth="3"),
    ]
    records, metrics = pool.score_batch(items)
    assert [r.status for r in records] == ["error", "ok", "error", "ok", "error", "ok"]
    assert [r.correct for r in records] == [False, True, False, False, False, True]
    assert all(r.score == -1.0 and r.extracted is None for r in records if r.status == "error")
    assert metrics["reward_pool/errors"] == 3
    assert any("RuntimeError: verifier bug" in e for e in pool.last_errors)
    assert any("TypeError" in e and "RewardRecord" in e for e in pool.last_errors)
    assert metrics["reward_pool/restarts"] == 1  # only the dying worker is replaced
    assert metrics["reward_pool/timeouts"] == 0


def test_unknown_method_is_a_config_error(pool):
    with pytest.raises(ValueError, match="valid names"):
        pool.score_batch([RewardItem(response="x", ground_truth="1", data_source="nope")])


def test_config_validation_and_close():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPoolConfig(timeout_s=0)
    with pytest.raises(ValueError, match="start_method"):
        RewardPoolConfig(start_method="threads")
    p = RewardPool(RewardPoolConfig(num_workers=1, start_method="spawn"))
    procs = [w.proc for w in p._workers]
    records, _ = p.score_batch([RewardItem(response="Answer: 5", ground_truth="5")])
    assert records[0].correct
    # A worker that died while idle is replaced before it is given work.
    p._workers[0].proc.kill()
    p._workers[0].proc.join()
    records, metrics = p.score_batch([RewardItem(response="Answer: 6", ground_truth="6")])
    assert records[0].correct and metrics["reward_pool/errors"] == 0 and metrics["reward_pool/restarts"] == 1
    procs = [w.proc for w in p._workers]
    p.close()
    assert not any(proc.is_alive() for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.score_batch([])
