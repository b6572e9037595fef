"""The process guard (``megatron_credit/lifetime.py``) on a small tree, stopped each way a trainer ends.

A stand-in trainer starts its guard, then the kinds of children a trainer has: a process started with
``exec`` (the reward workers, the rollout process, a spawned vLLM engine core) that starts one of its own
and then exits (so its child is re-parented: vLLM's engine core and its workers), and a ``fork`` child that
never calls ``exec`` (vLLM's fork start method), which carries no owner mark and is found only through the
guard's record. When the stand-in is killed with SIGKILL, that child ignores SIGTERM, so the guard's
SIGKILL after its grace period is exercised too. The stand-in then ends
the way the case says, without closing anything, and the test looks for any process left that carries
its mark (``tests/support/leftovers.py``: every process of the tree inherits it through exec or fork).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megatron_credit import lifetime
from tests.support.leftovers import left, marked_env, wait_until_none_left
from tests.support.paths import ROOT

TRAINER = r"""
import os, signal, subprocess, sys, time
from megatron_credit.lifetime import POLL_S, start_guard

record = sys.argv[2]
start_guard(record_path=record)
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
# an exec'd child that starts a grandchild and exits: the grandchild is re-parented
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:])", *sleeper]).wait()
subprocess.Popen(sleeper)
child = os.fork()
if child == 0:  # a fork child that never execs (and, for one case, ignores SIGTERM)
    if sys.argv[1] == "SIGKILL":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
deadline = time.monotonic() + 120  # a hang guard only: the wait is for the condition
while not (os.path.exists(record) and str(child) in open(record).read().split()):
    if time.monotonic() > deadline:
        sys.exit("the guard never recorded the fork child")
    time.sleep(POLL_S / 5)  # until the guard has recorded the fork child (it polls every POLL_S)
print("ready", flush=True)
sys.stdin.readline()  # the test has counted the tree
way = sys.argv[1]
if way == "error":
    raise ValueError("a user error mid-run")
if way == "success":
    os._exit(0)  # ends without joining its children (a clean exit that forgot one)
time.sleep(600)  # signalled by the test
"""


@pytest.mark.spawn
@pytest.mark.skipif(not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"), reason="Linux only")
@pytest.mark.parametrize("way", ["success", "error", "SIGTERM", "SIGUSR1", "SIGKILL"])
def test_no_descendant_outlives_a_trainer_however_it_ends(way, tmp_path):
    env, mark = marked_env(dict(os.environ, PYTHONPATH=ROOT))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, way, str(tmp_path / "record")], env=env, cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline() == "ready\n", trainer.communicate(timeout=30)[1][-2000:]
        # the guard, the sleeper, the grandchild, the fork child (and the stand-in itself)
        assert len(left(mark)) == 5, left(mark)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        sig = getattr(signal, way, None)
        if sig is not None:
            trainer.send_signal(sig)
        trainer.communicate(timeout=30)
        assert trainer.returncode == (-int(sig) if sig is not None else {"success": 0, "error": 1}[way])
        assert wait_until_none_left(mark, timeout_s=lifetime.GRACE_S + 20) == []  # SIGTERM, the grace, SIGKILL
    finally:
        for line in left(mark):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if trainer.poll() is None:
            trainer.kill()


def test_descendants_follow_parent_links():
    parents = {10: 1, 11: 10, 12: 11, 13: 1, 14: 10}
    assert sorted(lifetime.descendants(10, parents)) == [11, 12, 14]
    assert lifetime.descendants(12, parents) == []


def _blocked_signals(queue):
    import signal as sig

    queue.put(sorted(int(s) for s in sig.pthread_sigmask(sig.SIG_BLOCK, [])))


@pytest.mark.spawn
def test_children_started_in_the_shield_inherit_the_handled_exit_signals_blocked():
    """Inside ``checkpoint.exit_signals``' handlers, a worker (``start_worker``) and a multiprocessing child (as
    vLLM starts its engine core) start with SIGTERM and SIGUSR1 blocked, even when multiprocessing starts its
    resource tracker on the way (which unblocks SIGTERM in the starting thread); the block ends with it."""
    import multiprocessing
    import signal as sig

    from megatron_credit.lifetime import shield_children, shielded_signals

    before = sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGUSR1)
    mask = sig.pthread_sigmask(sig.SIG_BLOCK, [])
    try:
        assert shielded_signals() == set()
        with shield_children() as nothing:
            assert not nothing.signals
        sig.signal(sig.SIGTERM, lambda *_: None)
        sig.signal(sig.SIGUSR1, lambda *_: None)
        with shield_children() as shield:
            assert shield.signals == {sig.SIGTERM, sig.SIGUSR1}
            queue = multiprocessing.get_context("spawn").Queue()
            child = multiprocessing.get_context("spawn").Process(target=_blocked_signals, args=(queue,))
            child.start()
            got = queue.get(timeout=120)
            child.join(timeout=60)
        assert {int(sig.SIGTERM), int(sig.SIGUSR1)} <= set(got), got
        assert sig.pthread_sigmask(sig.SIG_BLOCK, []) == mask
    finally:
        sig.signal(sig.SIGTERM, before[0])
        sig.signal(sig.SIGUSR1, before[1])
