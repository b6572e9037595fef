"""A few locked-in worker processes that run tool code: a hung, greedy or nosy call costs one
worker, never the rollout.

An environment's tool (a calculator, a code runner) runs on text the policy wrote. ``Sandbox.run`` sends
a function *by reference* (``"module:qualname"``, imported by the worker) and one string argument to an
idle worker and waits at most ``timeout_s`` wall seconds for ``(ok, text)``. What can go wrong is one
answer, never an exception of ``run``:

- the function raises: ``(False, "ExcType: message")``; a ``MemoryError`` (past ``memory_limit_bytes``):
  ``(False, "out of memory")``; the worker goes on;
- the call overruns ``timeout_s``: the worker is SIGKILLed and replaced, ``(False, "timed out after Xs")``,
  ``kills`` counts it;
- the worker dies (the kernel's CPU limit, a crash): it is replaced, ``(False, "sandbox worker died ...")``.

How a worker locks itself in (memory, CPU, network, processes) is in ``sandbox_worker.py``.

Workers are ``python -m megatron_credit.env.sandbox_worker`` processes started with ``subprocess.Popen``
over a private socket pair, as the verifier workers are (``rewards/verifier_workers.py``): never a fork of the trainer,
whose CUDA context and threads must not be copied, and never multiprocessing's spawn, which re-imports the
trainer's ``__main__`` (torch, megatron) in every child. A worker imports only the standard library and
this torch-free package, so a start costs a fraction of a second. The constructor waits for all workers to
be ready; a replacement starts in the background and the first call that takes it waits for it, so a
worker's start-up never counts against a call's deadline. A worker exits when the parent's end of its
connection closes, so workers die with the parent.

``run`` is thread-safe: each call takes an idle worker from a queue (blocking until one is free, which
is at most about ``timeout_s``, since every busy worker answers or is killed by then), so several rollout
threads share one sandbox's workers.
"""
from __future__ import annotations

import queue
import subprocess
import threading

READY = "ready"
"""What a worker sends once it is locked in and serving (``sandbox_worker.py``)."""

_START_TIMEOUT_S = 60.0  # an interpreter start plus stdlib imports; generous for a loaded machine
_CLOSED_POLL_S = 0.5  # how often a caller waiting for an idle worker checks that the sandbox is still open


class _Worker:
    """One worker process and the parent's end of its connection."""

    def __init__(self, memory_limit_bytes: int, timeout_s: float):
        from megatron_credit.lifetime import start_worker

        self.proc, self.conn = start_worker("megatron_credit.env.sandbox_worker", str(memory_limit_bytes),
                                            repr(timeout_s))
        self.ready = False
        self.isolated = False
        """Whether the worker has its own (empty) network namespace."""

    def wait_ready(self) -> None:
        """Block until the worker reports ready; RuntimeError (after killing it) if it exits first or
        misses the start deadline."""
        problem = None
        try:
            if self.conn.poll(_START_TIMEOUT_S):
                tag, self.isolated = self.conn.recv()
                if tag != READY:
                    problem = f"sent {tag!r} instead of {READY!r}"
            else:
                problem = f"did not start within {_START_TIMEOUT_S:.0f} s"
        except (EOFError, OSError):
            problem = f"exited during start-up with exit code {self.exit_code()}; its traceback is on stderr"
        if problem is not None:
            self.kill()
            raise RuntimeError(f"sandbox worker (pid {self.proc.pid}) {problem}")
        self.ready = True

    def exit_code(self) -> int | None:
        """The exit code of a worker whose connection broke (None if it is somehow still running)."""
        try:
            return self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the process, reap it and close the connection (idempotent)."""
        from megatron_credit.lifetime import kill_and_reap

        kill_and_reap(self.proc, self.conn)


class Sandbox:
    """Run ``"module:qualname"`` functions on one string argument in killable, locked-in worker processes
    (module docstring). A context manager, or call :meth:`close`.

    ``workers``: the sandbox's worker processes; ``timeout_s``: wall seconds a call may take before its worker is
    killed; ``memory_limit_bytes``: each worker's address-space limit.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 2.0, memory_limit_bytes: int = 256 << 20):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Sandbox workers must be an int >= 1, got {workers!r}")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"Sandbox timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not isinstance(memory_limit_bytes, int) or memory_limit_bytes < 64 << 20:
            raise ValueError(f"Sandbox memory_limit_bytes must be an int >= 64 MiB (a worker's interpreter "
                             f"takes about 20 and its calls need room), got {memory_limit_bytes!r}")
        self.timeout_s = float(timeout_s)
        self.memory_limit_bytes = memory_limit_bytes
        self.kills = 0
        """Workers killed because a call overran ``timeout_s``."""
        self.restarts = 0
        """Workers replaced (killed, or died by themselves)."""
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._closed = False
        try:  # started together, awaited together; never leak the started ones if one fails
            started = [self._start() for _ in range(workers)]
            for w in started:
                w.wait_ready()
        except BaseException:
            self.close()
            raise
        self.network_isolated = all(w.isolated for w in started)
        """Whether the workers run in their own empty network namespace (where the kernel allows it); the
        audit hook refuses sockets either way."""
        for w in started:
            self._idle.put(w)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and tests)."""
        with self._lock:
            return sorted(w.proc.pid for w in self._workers)

    def run(self, ref: str, arg: str) -> tuple[bool, str]:
        """``(True, fn(arg))`` for the function ``ref`` = ``"module:qualname"``, or ``(False, why)`` when it
        raised, overran ``timeout_s`` or killed its worker (module docstring). Thread-safe.

        Raises ValueError for a malformed ``ref`` or a non-string ``arg``, RuntimeError when the sandbox is
        closed or a replacement worker cannot start.
        """
        module, _, qualname = ref.partition(":") if isinstance(ref, str) else ("", "", "")
        if not module or not qualname:
            raise ValueError(f"Sandbox.run ref must be 'module:qualname', got {ref!r}")
        if not isinstance(arg, str):
            raise ValueError(f"Sandbox.run arg must be a str, got {type(arg).__name__}")
        w = self._take()
        try:
            if not w.ready:
                w.wait_ready()
            w.conn.send((ref, arg))
            if not w.conn.poll(self.timeout_s):
                self._replace(w, killed=True)
                return False, f"timed out after {self.timeout_s:g}s"
            ok, text = w.conn.recv()
        except (EOFError, OSError):  # the worker died mid-call (CPU limit, crash) or the sandbox was closed
            code = w.exit_code()
            self._replace(w, killed=False)
            return False, f"sandbox worker died (exit code {code})"
        except BaseException:  # a start failure, Ctrl-C: the worker's state is unknown, so it goes
            self._replace(w, killed=False)
            raise
        self._idle.put(w)
        return ok, text

    def close(self) -> None:
        """Kill every worker (idempotent); later calls of :meth:`run` raise RuntimeError."""
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers), set()
        for w in workers:
            w.kill()

    def _start(self) -> _Worker:
        """A new worker, registered (still starting; RuntimeError if the sandbox was closed meanwhile)."""
        w = _Worker(self.memory_limit_bytes, self.timeout_s)
        with self._lock:
            if not self._closed:
                self._workers.add(w)
                return w
        w.kill()
        raise RuntimeError("Sandbox is closed")

    def _take(self) -> _Worker:
        """An idle worker, waiting for one; RuntimeError once the sandbox is closed."""
        while True:
            if self._closed:
                raise RuntimeError("Sandbox is closed")
            try:
                return self._idle.get(timeout=_CLOSED_POLL_S)
            except queue.Empty:
                pass

    def _replace(self, w: _Worker, *, killed: bool) -> None:
        """Kill ``w`` and put a fresh worker (not yet ready) in its place."""
        w.kill()
        with self._lock:
            self._workers.discard(w)
            if killed:
                self.kills += 1
            self.restarts += 1
        self._idle.put(self._start())
