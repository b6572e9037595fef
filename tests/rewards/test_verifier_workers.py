"""The verifier worker processes: order, per-item timeouts that kill and replace a worker, errors.

The hanging and raising verifiers are registered only here; workers import this module to unpickle
them (they are sent by reference).
"""
import os
import pickle
import signal
import sys
import time

import pytest

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, graded, method_for_data_source
from megatron_credit.rewards.math import compute_score
from megatron_credit.rewards import verifier_workers as verifier_workers_module
from megatron_credit.rewards.verifier_workers import RewardItem, VerifierWorkers, VerifierWorkersConfig


pytestmark = pytest.mark.spawn


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


def _slow_echo(response, ground_truth):
    time.sleep(0.05)
    return graded(response == ground_truth, response)


def _worker_modules(response, ground_truth):
    # What a worker process has imported: it must not re-run the parent's __main__ (torch, megatron).
    heavy = sorted(m for m in ("torch", "transformers", "megatron") if m in sys.modules)
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    return graded(not heavy and main == "megatron_credit.rewards.verifier_worker", f"{main}: {heavy}")


_TEST_FNS = [("test_hang", _hang), ("test_raise", _raise), ("test_die", _die), ("test_bad", _not_a_record),
             ("test_slow_echo", _slow_echo), ("test_modules", _worker_modules)]
for _name, _fn in _TEST_FNS:
    if _name not in REWARD_FNS:
        REWARD_FNS.add(_name, _fn)


@pytest.fixture(scope="module")
def workers():
    # 3 s: far above a verifier call even on a loaded CI machine, far below the hang.
    with VerifierWorkers(VerifierWorkersConfig(num_workers=2, timeout_s=3.0, chunk_size=4)) as p:
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


def test_the_workers_match_in_process_scoring(workers):
    items = _mixed_items(41)
    records, metrics = workers.score_batch(items)
    assert records == [_in_process(it) for it in items]
    assert metrics["verifier/items"] == 41
    assert metrics["verifier/timeouts"] == 0 and metrics["verifier/errors"] == 0
    assert metrics["verifier/accuracy"] == pytest.approx(sum(r.correct for r in records) / 41)
    empty, empty_metrics = workers.score_batch([])
    assert empty == [] and empty_metrics["verifier/items"] == 0


def test_hanging_item_times_out_and_worker_is_replaced(workers):
    responses = ["a", "b", "hang", "a", "hang", "b", "a"]
    items = [RewardItem(response=r, ground_truth="a", method="test_hang") for r in responses]
    items += _mixed_items(10)
    pids_before = {w.proc.pid for w in workers._workers}
    t0 = time.perf_counter()
    records, metrics = workers.score_batch(items)
    elapsed = time.perf_counter() - t0
    assert metrics["verifier/timeouts"] == 2
    assert metrics["verifier/restarts"] == 2
    assert metrics["verifier/errors"] == 0
    # Hung items: incorrect with status "timeout"; every other item scored as in-process.
    for item, rec in zip(items, records):
        if item.response == "hang":
            assert rec == RewardRecord(score=-1.0, correct=False, extracted=None, status="timeout")
        elif item.method == "test_hang":
            assert rec == graded(item.response == "a", item.response)
        else:
            assert rec == _in_process(item)
    assert elapsed < 30.0  # two 3 s deadlines, not an hour
    assert {w.proc.pid for w in workers._workers} != pids_before
    assert all(w.alive() for w in workers._workers)
    # The replaced workers serve the next batch.
    records, metrics = workers.score_batch(_mixed_items(6))
    assert records == [_in_process(it) for it in _mixed_items(6)] and metrics["verifier/timeouts"] == 0


def test_raising_dying_and_bad_verifiers_score_as_errors(workers):
    items = [
        RewardItem(response="x", ground_truth="1", method="test_raise"),
        RewardItem(response="Answer: 1", ground_truth="1"),
        RewardItem(response="x", ground_truth="1", method="test_die"),
        RewardItem(response="Answer: 2", ground_truth="1"),
        RewardItem(response="x", ground_truth="1", method="test_bad"),
        RewardItem(response="Answer: 3", ground_truth="3"),
    ]
    records, metrics = workers.score_batch(items)
    assert [r.status for r in records] == ["error", "ok", "error", "ok", "error", "ok"]
    assert [r.correct for r in records] == [False, True, False, False, False, True]
    assert all(r.score == -1.0 and r.extracted is None for r in records if r.status == "error")
    assert metrics["verifier/errors"] == 3
    assert any("RuntimeError: verifier bug" in e for e in workers.last_errors)
    assert any("TypeError" in e and "RewardRecord" in e for e in workers.last_errors)
    assert metrics["verifier/restarts"] == 1  # only the dying worker is replaced
    assert metrics["verifier/timeouts"] == 0


def test_unknown_method_is_a_config_error(workers):
    with pytest.raises(ValueError, match="valid names"):
        workers.score_batch([RewardItem(response="x", ground_truth="1", data_source="nope")])


def test_config_validation_and_close():
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierWorkersConfig(timeout_s=0)
    with pytest.raises(ValueError, match="chunk_size"):
        VerifierWorkersConfig(chunk_size=0)
    p = VerifierWorkers(VerifierWorkersConfig(num_workers=1))
    records, _ = p.score_batch([RewardItem(response="Answer: 5", ground_truth="5")])
    assert records[0].correct
    # A worker that died while idle is replaced before it is given work.
    p._workers[0].proc.kill()
    p._workers[0].proc.wait()
    records, metrics = p.score_batch([RewardItem(response="Answer: 6", ground_truth="6")])
    assert records[0].correct and metrics["verifier/errors"] == 0 and metrics["verifier/restarts"] == 1
    procs = [w.proc for w in p._workers]
    p.close()
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.score_batch([])


def test_workers_do_not_import_the_parents_main(workers):
    # Workers are `python -m megatron_credit.rewards.verifier_worker`, not multiprocessing children that
    # re-import __main__ (a trainer's torch/megatron imports cost seconds per worker restart).
    records, _ = workers.score_batch([RewardItem(response="", ground_truth="", method="test_modules")])
    assert records[0].correct, f"worker imported {records[0].extracted}"


def test_exception_escaping_a_batch_does_not_leak_answers_into_the_next(workers):
    class _Interrupt(Exception):
        pass

    def _on_alarm(*_):
        raise _Interrupt()

    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        stale = [RewardItem(response=f"old{i}", ground_truth=f"old{i}", method="test_slow_echo")
                 for i in range(16)]
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # a Ctrl-C in the middle of the batch
        with pytest.raises(_Interrupt):
            workers.score_batch(stale)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not any(w.owed for w in workers._workers)
    fresh = [RewardItem(response=f"new{i}", ground_truth=f"new{i}", method="test_slow_echo")
             for i in range(16)]
    records, metrics = workers.score_batch(fresh)
    assert [r.extracted for r in records] == [f"new{i}" for i in range(16)]
    assert all(r.correct for r in records) and metrics["verifier/timeouts"] == 0
    assert metrics["verifier/errors"] == 0


def test_unsendable_verifier_is_a_value_error_naming_the_method(workers):
    def _closure(response, ground_truth):
        return graded(True, response)

    for name, fn in [("test_lambda", lambda r, g: graded(r == g, r)), ("test_closure", _closure)]:
        if name not in REWARD_FNS:
            REWARD_FNS.add(name, fn)
        with pytest.raises(ValueError, match=name):
            workers.score_batch([RewardItem(response="1", ground_truth="1", method=name)])
    assert not any(w.owed for w in workers._workers)
    records, _ = workers.score_batch([RewardItem(response="Answer: 1", ground_truth="1")])
    assert records[0].correct
    pickle.dumps(_slow_echo)  # module-level functions of an importable module are fine


def test_a_verifier_of_a_plugin_file_scores_in_the_workers(workers, tmp_path):
    """A verifier that a ``--plugin`` file registers (loaded by path, under a module name no worker can
    import) is sent as the file's path: the workers load the file and score with it."""
    from megatron_credit.plugins import load_plugin

    plugin = tmp_path / "my_verifier.py"
    plugin.write_text(
        "from megatron_credit.rewards.base import REWARD_FNS, graded\n"
        "import os\n"
        "def last_word(response, ground_truth):\n"
        "    return graded(response.split()[-1] == ground_truth, f'{response.split()[-1]}@{os.getpid()}')\n"
        "if 'test_plugin_last_word' not in REWARD_FNS:\n"
        "    REWARD_FNS.add('test_plugin_last_word', last_word)\n")
    module = load_plugin(str(plugin))
    assert module.__name__ == "megatron_credit_plugin_my_verifier"
    items = [RewardItem(response=f"so it is {w}", ground_truth="blue", method="test_plugin_last_word")
             for w in ("blue", "red", "blue", "green")]
    records, metrics = workers.score_batch(items)
    assert metrics["verifier/errors"] == 0
    assert [r.correct for r in records] == [True, False, True, False]
    words, pids = zip(*(r.extracted.split("@") for r in records))
    assert words == ("blue", "red", "blue", "green") and str(os.getpid()) not in pids  # scored in the workers


def test_a_verifier_module_slow_to_import_is_not_a_timeout(tmp_path):
    """A task library's verifier module that takes longer to import than the per-item timeout: the first
    chunk a worker gets that names it has IMPORT_GRACE_S more for the import, every item scores, none times
    out. (A hanging item after the import keeps the plain deadline: the hang test above.)"""
    from megatron_credit.plugins import load_plugin

    plugin = tmp_path / "slow_import_verifier.py"
    plugin.write_text(
        "import os, time\n"
        "from megatron_credit.rewards.base import REWARD_FNS, graded\n"
        "if os.environ.get('MC_TEST_PARENT') != str(os.getpid()):\n"
        "    time.sleep(2.5)  # a heavy library's import, in the workers\n"
        "def same(response, ground_truth):\n"
        "    return graded(response == ground_truth, response)\n"
        "if 'test_slow_import' not in REWARD_FNS:\n"
        "    REWARD_FNS.add('test_slow_import', same)\n")
    os.environ["MC_TEST_PARENT"] = str(os.getpid())
    try:
        load_plugin(str(plugin))
        items = [RewardItem(response=str(i % 3), ground_truth="1", method="test_slow_import") for i in range(6)]
        with VerifierWorkers(VerifierWorkersConfig(num_workers=2, timeout_s=1.0, chunk_size=3)) as p:
            for _ in range(2):
                records, metrics = p.score_batch(items)
                assert metrics["verifier/timeouts"] == 0 and metrics["verifier/errors"] == 0
                assert [r.correct for r in records] == [i % 3 == 1 for i in range(6)]
            assert all(w.modules == {str(plugin)} for w in p._workers)
    finally:
        del os.environ["MC_TEST_PARENT"]


def test_blocked_parent_does_not_time_out_healthy_workers(monkeypatch):
    # While the parent is busy (a slow replacement start, a loaded machine) for longer than timeout_s,
    # a healthy worker's answers pile up unread; they must be read before its deadline is judged.
    with VerifierWorkers(VerifierWorkersConfig(num_workers=2, timeout_s=2.0, chunk_size=4)) as p:
        start_worker = p._start_worker

        def slow_start():
            time.sleep(3.0)
            return start_worker()

        monkeypatch.setattr(p, "_start_worker", slow_start)
        items = [RewardItem(response="hang", ground_truth="x", method="test_hang")]
        items += [RewardItem(response=f"r{i}", ground_truth=f"r{i}", method="test_slow_echo")
                  for i in range(40)]
        records, metrics = p.score_batch(items)
        assert metrics["verifier/timeouts"] == 1, "".join(r.status[0] for r in records)
        assert records[0].status == "timeout" and all(r.correct for r in records[1:])


def test_worker_that_dies_at_start_is_reported_and_no_worker_leaks(monkeypatch):
    started = []

    class _Tracked(verifier_workers_module._Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(verifier_workers_module, "_Worker", _Tracked)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="exited during start-up with exit code 1"):
        VerifierWorkers(VerifierWorkersConfig(num_workers=2))
    assert len(started) == 2 and all(w.proc.poll() is not None and w.conn.closed for w in started)
