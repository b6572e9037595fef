"""Shared pytest set-up: GPU-marked tests are skipped with a reason on machines without CUDA; a test that
starts a process without its ``dist`` / ``spawn`` marker fails (``tests/support/spawn_guard.py``)."""
import os
import re

# Spawned gloo workers and the main process share 2 cores in CI: one intra-op thread each. Set before
# torch loads its OpenMP runtime: mutmut forks its mutant runs from this process, and a child forked from
# a process whose OpenMP pool has several threads hangs in its first parallel region (GNU libgomp is not
# fork-safe), which mutmut then reports as a timeout.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support import spawn_guard  # noqa: E402

spawn_guard.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    spawn_guard.running(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    spawn_guard.running(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    spawn_guard.running(item)
    try:
        return (yield)
    finally:
        spawn_guard.running(None)


def pytest_collection_modifyitems(config, items):
    if "MUTANT_UNDER_TEST" in os.environ:
        _deselect_distributed_under_mutmut(config, items)
        _short_timeouts_under_mutmut(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: this machine has no GPU (run on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _deselect_distributed_under_mutmut(config, items):
    """Under ``make mutation`` (mutmut sets MUTANT_UNDER_TEST), leave out the tests that spawn gloo
    workers (the ``pool`` fixture). mutmut's fork runner collects its mutant children with
    ``os.wait()``, which also reaps the spawned workers of the traced in-process stats run and then
    crashes on the unknown pid (KeyError in ``wait_for_result``); and the code those workers run is
    invisible to mutmut's tracing anyway, so these tests could never kill a mutant there. The
    ``[threads]`` runs of ``tests.support.threaded_harness.gloo_and_threads_pool`` (ranks as threads of this
    process) stay: they are what reaches the distributed code under mutmut."""
    def spawns(item):  # the DistributedPool fixtures are named pool, pool1, pool2, pool4
        params = getattr(getattr(item, "callspec", None), "params", {})
        return any(re.fullmatch(r"pool\d*", name) and params.get(name) != "threads"
                   for name in getattr(item, "fixturenames", ()))

    spawned = [item for item in items if spawns(item)]
    if spawned:
        config.hook.pytest_deselected(items=spawned)
        items[:] = [item for item in items if not spawns(item)]


MUTATION_TEST_TIMEOUT_S = 30.0
"""Under ``make mutation``, a test still running after this many seconds fails (``MUTATION_TEST_TIMEOUT_S``
in the environment overrides it). The slowest test of the mutation selection takes about 3.3 s in
mutmut's traced stats run; setup.cfg's ``timeout_constant`` keeps mutmut's own limit above this one."""


def _short_timeouts_under_mutmut(items):
    """Under ``make mutation``, every test without a timeout marker of its own fails after
    ``MUTATION_TEST_TIMEOUT_S`` (pytest-timeout), instead of pytest.ini's 900 s. A mutant that makes a loop
    run forever (``s = 0`` in the scan's doubling loop, ``s *= 2`` turned into ``s /= 2``) then fails its
    test within seconds: a hang is a failure the tests detect, so the mutant counts as killed, and
    it costs half a minute instead of running into mutmut's own CPU limit (30 x the tests' measured time,
    reported as a timeout, which ``tools/mutation_report.py`` never counts as a kill)."""
    limit = float(os.environ.get("MUTATION_TEST_TIMEOUT_S", MUTATION_TEST_TIMEOUT_S))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))


def pytest_sessionfinish(session, exitstatus):
    """Shut down megatron's dist-checkpoint results queue, if a test saved a checkpoint in this process.

    ``FileSystemWriterAsync`` keeps one ``multiprocessing`` spawn ``Manager().Queue()`` per process
    (``filesystem_async._results_queue``), whose server process is stopped only by the interpreter's exit
    handlers. mutmut (and any runner that forks a pytest per mutant) ends its children with ``os._exit``,
    which skips them: every in-process conversion test left one orphaned server (~270 MB each) behind.
    The queue is reset too, so a process forked after this session (mutmut's mutant runs, forked from
    the one that ran the stats pass) starts its own instead of talking to a stopped one."""
    import multiprocessing
    import sys

    fsa = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if fsa is None or getattr(fsa, "_results_queue", None) is None:
        return
    fsa._results_queue = None
    for child in multiprocessing.active_children():
        if child.name.startswith("SyncManager"):
            child.terminate()
            child.join(10)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a dequantized HF folder, imported once per session (tests/support/real_model.py)."""
    from tests.support.real_model import provide

    return provide(tmp_path_factory)
