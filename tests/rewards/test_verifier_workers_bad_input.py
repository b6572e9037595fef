"""Bad input at the verifier workers: slow items spread over the workers, a memory bomb is one counted error.

The verifiers below are registered only here; the verifier workers import this module to find them.
"""
from __future__ import annotations

import os
import time

import pytest

from megatron_credit.rewards.base import REWARD_FNS, graded
from megatron_credit.rewards.verifier_workers import RewardItem, VerifierWorkers, VerifierWorkersConfig


pytestmark = pytest.mark.spawn


def _which_worker(response, ground_truth):
    time.sleep(0.2)  # long enough that the other worker is busy too if it got an item
    return graded(False, str(os.getpid()))


def _allocate(response, ground_truth):
    block = bytearray(int(response))  # a verifier building a huge object (sympy on 2^{2^{40}})
    return graded(len(block) > 0, "allocated")


for _name, _fn in (("test_which_worker", _which_worker), ("test_allocate", _allocate)):
    if _name not in REWARD_FNS:
        REWARD_FNS.add(_name, _fn)


@pytest.fixture(scope="module")
def workers():
    with VerifierWorkers(VerifierWorkersConfig(num_workers=2, timeout_s=30.0, chunk_size=16,
                                     memory_limit_bytes=1024**3)) as p:
        yield p


@pytest.mark.parametrize("n", [2, 3])
def test_a_small_batch_is_spread_over_the_workers(workers, n):
    """Before: the default chunk sent both items of [slow, slow] to one worker (2 x 60 s)."""
    items = [RewardItem(response=f"r{i}", ground_truth="x", method="test_which_worker") for i in range(n)]
    records, metrics = workers.score_batch(items)
    pids = [r.extracted for r in records]
    assert sorted(set(pids)) == sorted(str(p) for p in workers.worker_pids())  # both workers used
    assert metrics["verifier/errors"] == 0 and metrics["verifier/timeouts"] == 0


def test_memory_bomb_is_a_counted_error_and_the_worker_survives(workers):
    items = [RewardItem(response=str(4 * 1024**3), ground_truth="x", method="test_allocate"),
             RewardItem(response="1024", ground_truth="x", method="test_allocate")]
    records, metrics = workers.score_batch(items)
    assert [r.status for r in records] == ["error", "ok"] and records[1].correct
    assert metrics["verifier/errors"] == 1 and metrics["verifier/restarts"] == 0
    assert workers.last_errors == ["item 0: MemoryError: over the worker's memory limit"]


def test_workers_config_refuses_a_limit_below_the_imports():
    with pytest.raises(ValueError, match="memory_limit_bytes must be None or >= 256 MiB"):
        VerifierWorkersConfig(memory_limit_bytes=1024)
    assert VerifierWorkersConfig().memory_limit_bytes == 4 * 1024**3 and VerifierWorkersConfig(memory_limit_bytes=None)


def test_worker_limit_is_set_in_the_worker_process():
    """``limit_address_space`` in a child: the next allocation over the limit fails there."""
    import subprocess
    import sys

    code = ("from megatron_credit.rewards.verifier_worker import limit_address_space\n"
            "import resource\n"
            "limit_address_space(2 * 1024**3)\n"
            "print(resource.getrlimit(resource.RLIMIT_AS))\n"
            "try:\n    bytearray(3 * 1024**3)\nexcept MemoryError:\n    print('MemoryError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == [f"({2 * 1024**3}, {2 * 1024**3})", "MemoryError"]


def _sleep_1s(response, ground_truth):
    time.sleep(1.0)
    return graded(True, "slept")


if "test_sleep_1s" not in REWARD_FNS:
    REWARD_FNS.add("test_sleep_1s", _sleep_1s)


def test_a_batch_deadline_bounds_a_batch_of_slow_items_and_counts_them():
    """100 hostile items once took 290 s with 2 workers (a deadline per item only)."""
    with VerifierWorkers(VerifierWorkersConfig(num_workers=2, timeout_s=30.0, batch_timeout_s=1.5,
                                     memory_limit_bytes=None)) as p:
        items = [RewardItem(response=f"r{i}", ground_truth="x", method="test_sleep_1s") for i in range(10)]
        t0 = time.monotonic()
        records, metrics = p.score_batch(items)
        took = time.monotonic() - t0
        statuses = [r.status for r in records]
        assert took < 4.0, took  # 10 items x 1 s on 2 workers: 5 s without the batch deadline
        # each worker got 5 items and answers one a second: at most its first in time (none on a loaded CPU)
        assert statuses.count("ok") <= 2 and statuses.count("ok") + statuses.count("timeout") == 10, statuses
        assert metrics["verifier/timeouts"] == statuses.count("timeout") >= 8
        assert metrics["verifier/restarts"] == 2  # both still owed answers: killed and replaced
        assert all(not r.correct for r in records if r.status == "timeout")
        quick = [RewardItem(response="1", ground_truth="x", method="test_allocate")]
        assert p.score_batch(quick)[0][0].status == "ok"  # the replaced workers serve the next batch


def test_batch_deadline_must_be_positive():
    with pytest.raises(ValueError, match="batch_timeout_s must be > 0 or None"):
        VerifierWorkersConfig(batch_timeout_s=0)
