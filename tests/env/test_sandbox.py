"""The sandbox runs functions in killable, locked-in workers: results and errors come back as values, a
hung call is killed at its deadline, a greedy one gets a MemoryError, sockets and processes are refused,
concurrent callers share the workers, and workers never outlive the parent."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megatron_credit.env.sandbox import Sandbox

pytestmark = pytest.mark.spawn

T = "tests.env.sandbox_targets"
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=TIMEOUT_S, memory_limit_bytes=256 << 20) as box:
        yield box


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_results_and_function_errors_come_back_as_values(sandbox):
    assert sandbox.run(f"{T}:shout", "abc") == (True, "ABC!")
    assert sandbox.run(f"{T}:fail", "input") == (False, "ValueError: bad input")
    assert sandbox.run(f"{T}:not_a_string", "abc") == (False, f"TypeError: {T}:not_a_string returned int, not str")
    ok, why = sandbox.run(f"{T}:missing", "x")
    assert not ok and why.startswith("AttributeError:")
    ok, why = sandbox.run("no_such_module_xyz:f", "x")
    assert not ok and why.startswith("ModuleNotFoundError:")
    assert sandbox.run("megatron_credit.env.calc_eval:evaluate", "6*7") == (True, "42")


def test_bad_arguments_are_refused_in_the_parent(sandbox):
    with pytest.raises(ValueError, match="ref must be 'module:qualname', got 'shout'"):
        sandbox.run("shout", "x")
    with pytest.raises(ValueError, match="arg must be a str, got int"):
        sandbox.run(f"{T}:shout", 3)
    with pytest.raises(ValueError, match="Sandbox workers must be an int >= 1, got 0"):
        Sandbox(workers=0)
    with pytest.raises(ValueError, match="Sandbox timeout_s must be a finite number > 0, got -1"):
        Sandbox(timeout_s=-1)
    with pytest.raises(ValueError, match="Sandbox memory_limit_bytes must be an int >= 64 MiB"):
        Sandbox(memory_limit_bytes=1 << 20)


def test_a_call_that_spins_is_killed_at_its_deadline_and_the_sandbox_goes_on(sandbox):
    kills, pids = sandbox.kills, set(sandbox.worker_pids())
    start = time.monotonic()
    assert sandbox.run(f"{T}:spin", "") == (False, "timed out after 1s")
    elapsed = time.monotonic() - start
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
    assert sandbox.kills == kills + 1
    new_pids = set(sandbox.worker_pids())
    assert len(new_pids) == 2 and len(new_pids - pids) == 1  # one worker replaced
    for _ in range(3):  # both workers, the replacement included, serve
        assert sandbox.run(f"{T}:shout", "after") == (True, "AFTER!")


def test_a_call_past_the_memory_limit_is_out_of_memory_and_the_sandbox_goes_on(sandbox):
    assert sandbox.run(f"{T}:allocate", "1024") == (False, "out of memory")
    assert sandbox.run(f"{T}:allocate", "16") == (True, str(16 << 20))


def test_a_worker_that_dies_is_replaced(sandbox):
    restarts, kills = sandbox.restarts, sandbox.kills
    assert sandbox.run(f"{T}:crash", "3") == (False, "sandbox worker died (exit code 3)")
    assert (sandbox.restarts, sandbox.kills) == (restarts + 1, kills)
    assert [sandbox.run(f"{T}:shout", "x") for _ in range(3)] == [(True, "X!")] * 3


@pytest.mark.parametrize("name, event", [
    ("open_socket", "socket.__new__"), ("resolve", "socket.getaddrinfo"), ("start_process", "subprocess.Popen"),
    ("shell", "os.system"), ("fork", "os.fork"),
])
def test_network_and_processes_are_refused(sandbox, name, event):
    assert sandbox.run(f"{T}:{name}", "localhost") == (False, f"PermissionError: sandbox: {event} is not allowed")


def test_workers_are_torch_free_and_report_their_network_namespace(sandbox):
    assert sandbox.run(f"{T}:loaded_modules", "torch,numpy,megatron_credit.env.calc_eval") == \
        (True, "megatron_credit.env.calc_eval")
    ok, namespace = sandbox.run(f"{T}:network_namespace", "")
    assert ok and namespace.startswith("net:[")
    # Where the kernel allows user namespaces the worker has its own network; elsewhere the hook alone.
    assert (namespace != os.readlink("/proc/self/ns/net")) == sandbox.network_isolated


def test_concurrent_callers_get_their_own_results(sandbox):
    results: dict[tuple[int, int], tuple[bool, str]] = {}

    def caller(t: int) -> None:
        for i in range(5):
            results[t, i] = sandbox.run("megatron_credit.env.calc_eval:evaluate", f"{t} * 100 + {i}")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert results == {(t, i): (True, str(t * 100 + i)) for t in range(4) for i in range(5)}


def test_close_kills_the_workers_and_refuses_later_calls():
    box = Sandbox(workers=1, timeout_s=TIMEOUT_S)
    pids = box.worker_pids()
    box.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="Sandbox is closed"):
        box.run(f"{T}:shout", "x")


def test_workers_die_with_the_parent():
    """A parent that exits without close(): the idle worker sees EOF, the spinning one hits its alarm."""
    script = textwrap.dedent(f"""
        import os, threading, time
        from megatron_credit.env.sandbox import Sandbox
        box = Sandbox(workers=2, timeout_s={TIMEOUT_S})
        threading.Thread(target=box.run, args=("{T}:spin", ""), daemon=True).start()
        time.sleep(0.3)
        print(*box.worker_pids(), flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10.0  # the spinning worker's alarm: ceil(1 s) + 1 = 2 s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
