"""No process outlives its run: the one mechanism that ends every process a trainer started.

A trainer rank starts processes of several kinds: the verifier workers, the rollout pool's ranks of
``rollout.mode: one_step_off | async`` (without torchrun), vLLM's engine-core and worker processes (started by vLLM, some by
``fork``), and whatever those start in turn. Each kind has its own orderly shutdown (``close()`` on every
exit path the trainer survives). What no ``close()`` covers is a trainer that dies without running it:
SIGKILL (Slurm's ``KillWait``, the OOM killer), a crash in native code, or a child's own shutdown that
hangs. So each trainer process starts one **guard** (:func:`start_guard`), a small standard-library
process in a session of its own (a signal sent to the trainer's process group does not reach it):

- While the trainer lives, the guard records the trainer's descendants every :data:`POLL_S` seconds
  (by parent id, with their start times, so a reused pid is never mistaken for one of them). A process
  keeps its place in the record after its parent dies and it is re-parented, which walking the tree
  at the end could no longer see.
- The trainer puts :data:`OWNER_ENV` (``<pid>:<start time>``) into its environment, so every process
  started later with ``exec`` carries it, including one started and re-parented between two polls.
- When the trainer is gone, however it ended (the guard waits on a pidfd, so it learns at once), the
  guard sends SIGTERM to every recorded process still alive and to every process carrying the owner
  mark, and their descendants; after :data:`GRACE_S` seconds, SIGKILL to those left. Then it exits.

The guard only acts after the trainer is gone, so on the ordinary paths (success, a user error, an
exception, SIGTERM or SIGUSR1, each followed by ``close()``) it finds nothing left and exits; it kills
only what an orderly shutdown left behind. A guard that is itself killed leaves the children's own
watches (the verifier worker's pipe, the rollout pool rank's parent poll) as they were.

Linux only (``/proc``, ``pidfd_open``); elsewhere :func:`start_guard` does nothing and says so.
Standard library only: the guard process imports nothing else.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

OWNER_ENV = "MEGATRON_CREDIT_OWNER"
"""``<pid>:<start time>`` of the trainer process whose guard ends this process (inherited through exec)."""
POLL_S = 0.5
"""How often the guard records the trainer's descendants (a process that lives shorter than this and
carries no owner mark may escape the record; it also escapes nothing else)."""
GRACE_S = 5.0
"""Seconds between the guard's SIGTERM and its SIGKILL to the processes left behind."""
_GUARD: subprocess.Popen | None = None
"""This process's guard (held so that it is never collected, which would warn while it runs)."""


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[19])


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process this user can see."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                out[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read
    return out


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every process whose chain of parents reaches ``pid`` (not ``pid`` itself), by the table now."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def marked(value: str) -> list[int]:
    """Processes whose environment (as they were exec'd) holds ``OWNER_ENV=value``."""
    needle = f"{OWNER_ENV}={value}".encode() + b"\0"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    out.append(int(name))
        except OSError:
            continue  # gone, or another user's
    return out


def start_guard(*, log=None, record_path: str | None = None) -> subprocess.Popen | None:
    """Start this process's guard (module docstring) and mark the environment its later children inherit.
    Returns the guard's process (the caller never waits for it: it exits on its own after this process),
    or None where the platform lacks ``/proc`` or ``pidfd_open``. Call once, early, in the trainer.

    ``record_path``: the guard rewrites this file (atomically, one pid a line) after each poll that
    changed its record, so that one can see which processes it would end (a test waits on it)."""
    global _GUARD
    if _GUARD is not None and _GUARD.poll() is None and os.environ.get(OWNER_ENV, "").startswith(f"{os.getpid()}:"):
        return _GUARD  # this process's guard is running
    me = os.getpid()
    born = start_time(me)
    if born is None or not hasattr(os, "pidfd_open"):
        if log is not None:
            log("note: no process guard on this platform (needs Linux /proc and pidfd_open): a trainer killed "
                "with SIGKILL may leave its children running")
        return None
    owner = f"{me}:{born}"
    os.environ[OWNER_ENV] = owner
    # A session of its own: torchrun's killpg of the worker's group, or Ctrl-C, must not end the guard first.
    # Run as a file, not ``-m``: it needs only the standard library, whatever the child's sys.path.
    argv = [sys.executable, os.path.abspath(__file__), owner, *([os.path.abspath(record_path)] if record_path else [])]
    _GUARD = subprocess.Popen(argv, start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    return _GUARD


def _signal_all(pids, sig: int, born: dict[int, int | None]) -> list[int]:
    """Send ``sig`` to each pid still the process recorded (same start time); the pids it reached."""
    reached = []
    for pid in pids:
        if pid == os.getpid() or (born.get(pid) is not None and start_time(pid) != born[pid]):
            continue  # this guard, or the pid now names another process
        try:
            os.kill(pid, sig)
            reached.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return reached


def _left(owner: str, recorded: dict[int, int | None]) -> dict[int, int | None]:
    """The processes to end: those recorded, those marked with ``owner``, and the descendants of both."""
    parents = _parents()
    found = {p: b for p, b in recorded.items() if start_time(p) == b}
    for pid in marked(owner):
        found.setdefault(pid, start_time(pid))
    for pid in list(found):
        for d in descendants(pid, parents):
            found.setdefault(d, start_time(d))
    found.pop(os.getpid(), None)
    return {p: b for p, b in found.items() if b is not None}


def _alive(pid: int, born: int | None) -> bool:
    """Whether ``pid`` is still the recorded process and not a zombie waiting to be reaped."""
    if start_time(pid) != born:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _write_record(path: str, recorded: dict[int, int | None]) -> None:
    """``path`` holds the recorded pids, one a line; written to a temporary file and renamed."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{p}\n" for p in sorted(recorded)))
    os.replace(tmp, path)


def guard(owner: str, record_path: str | None = None) -> None:
    """The guard's main (module docstring): record the owner's descendants until it is gone, then end them."""
    pid, born = (int(x) for x in owner.split(":"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a scheduler's SIGTERM is for the trainer to act on
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    recorded: dict[int, int | None] = {}
    while fd is not None and start_time(pid) == born:
        size = len(recorded)
        for d in descendants(pid):
            recorded.setdefault(d, start_time(d))
        if record_path is not None and len(recorded) != size:
            _write_record(record_path, recorded)
        if select.select([fd], [], [], POLL_S)[0]:
            break  # the owner exited (the pidfd turns readable)
    left = _left(owner, recorded)
    if not left:
        return
    _signal_all(left, signal.SIGTERM, left)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p, b) for p, b in left.items()):
        time.sleep(0.1)
    left.update(_left(owner, {p: b for p, b in left.items() if _alive(p, b)}))  # and what they started since
    _signal_all([p for p, b in left.items() if _alive(p, b)], signal.SIGKILL, left)


if __name__ == "__main__":
    guard(*sys.argv[1:3])


def kill_and_reap(proc: subprocess.Popen, conn) -> None:
    """SIGKILL a worker process, reap it and close its connection (idempotent): the verifier workers and
    the tool sandbox's workers end this way."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    conn.close()


def requests(conn):
    """A worker's messages from its parent until ``None`` (stop) or the connection breaks (the parent is
    gone): the serving loop of the verifier workers and the tool sandbox's workers."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        yield message


SHIELDED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
"""Signals the processes a trainer starts get blocked, when the trainer handles them itself (a Python handler:
the run's exit signals, ``checkpoint.exit_signals``). Slurm sends its warning signal to every process of the
job step, and a launcher may signal the whole process group: a signal meant for the trainer, which finishes
the iteration in flight and saves it, must not end a reward worker or an engine that iteration needs. A
blocked mask survives ``fork`` and ``exec`` (a handler does not: ``exec`` resets it to the default, which for
SIGUSR1 is to terminate), and no handler a child installs unblocks it. SIGINT is left alone: Ctrl-C is the
trainer's, and vLLM's engine core is asked to shut down in order with it."""


def shielded_signals() -> set:
    """The :data:`SHIELDED_SIGNALS` this process handles with a Python handler (neither the default nor
    ignored); empty outside the trainer's ``checkpoint.exit_signals`` block."""
    return {getattr(signal, n) for n in SHIELDED_SIGNALS
            if hasattr(signal, n) and callable(signal.getsignal(getattr(signal, n)))}


class shield_children:
    """``with shield_children():`` processes started in the block (from this thread) inherit the
    :func:`shielded_signals` blocked; a signal that arrives meanwhile waits and reaches this process's
    handler when the block ends. ``bool(self.signals)``: whether anything was shielded."""

    def __enter__(self) -> "shield_children":
        self.signals = shielded_signals()
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals) if self.signals else None
        if self.signals:
            # multiprocessing starts its resource tracker on a first spawn with SIGINT and SIGTERM blocked, then
            # unblocks both in the calling thread: started here (shielded too), then the block is made again.
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        return self

    def __exit__(self, *exc) -> None:
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)


def start_worker(module: str, *args: str):
    """``python -m module FD *args``, ``FD`` one end of a socket pair that the child inherits (no fork of this
    process, no multiprocessing start method), with this process's ``sys.path`` as its PYTHONPATH (what the
    worker imports by name resolves as here); returns the process and the parent's end as a
    ``multiprocessing.connection.Connection``: how the verifier workers and the tool sandbox's workers start."""
    import socket
    from multiprocessing.connection import Connection

    path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    parent, child = socket.socketpair()
    try:
        with shield_children():  # the run's exit signals are the trainer's: the worker ends by SIGKILL
            proc = subprocess.Popen([sys.executable, "-m", module, str(child.fileno()), *args],
                                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, Connection(parent.detach())
