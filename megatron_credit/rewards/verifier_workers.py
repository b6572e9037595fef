"""Verifier worker processes that can be killed: a hung verifier never stops training.

``math-verify`` can hang on hostile input (sympy on a pathological expression), and its signal-based
timeout works only in a main thread. ``concurrent.futures.ProcessPoolExecutor`` cannot kill one hung
worker (its only remedy is to break the whole executor). So ``VerifierWorkers`` owns its processes: each
worker has a private pipe, receives a chunk of items, and answers item by item. The parent waits on all pipes with a
deadline per *item* (the clock restarts at each answer, and answers already sent are always read before
any deadline is checked); when a worker misses its deadline it is killed (SIGKILL) and replaced, the
item it was on is scored as a timeout, and the rest of its chunk is re-queued. A verifier that raises,
or a worker that dies, scores that item as an error. Timeouts and errors score as incorrect
(``score=-1, correct=False``), carry ``status="timeout"``/``"error"`` and are counted in the metrics;
``score_batch`` itself never raises for them.

Workers are plain ``python -m megatron_credit.rewards.verifier_worker`` processes (``subprocess.Popen``,
the pipe passed as an inherited socket), not multiprocessing children: multiprocessing's spawn and
forkserver re-import the parent's ``__main__`` in every child, which for a trainer that imports torch
and megatron makes each worker start or restart take seconds; fork would copy CUDA contexts and
process-group threads. A worker imports only the verifiers (sympy, ~1 s) and makes one warm-up call
before it reports ready. ``VerifierWorkers`` waits for that at construction; a replacement after a kill
starts in the background and gets work once it is ready, so a restart never blocks the healthy workers
and its start-up cost never counts against an item's deadline.

Verifier callables are sent to workers by reference (module + qualified name, imported by the worker),
so a function registered in ``REWARD_FNS`` at module level of any importable module (a test file, a
plug-in) works in a worker; a lambda, closure, callable object or a function defined in ``__main__``
is rejected with a ValueError naming the method. The child's ``sys.path`` is the parent's.

Items are spread over the workers: a chunk is at most ``ceil(pending / num_workers)`` items (and at
most ``chunk_size``), so a batch of at most ``num_workers`` items sends one item per worker and two slow
items never queue behind each other while a worker is idle. In larger batches a slow item delays at most
the ``chunk_size - 1`` items after it in its chunk; ``chunk_size=1`` removes even that, at the cost
of one pipe round trip per item.

Each worker runs under an address-space limit (``VerifierWorkersConfig.memory_limit_bytes``, default
4 GiB, ``RLIMIT_AS``): a verifier that tries to build a huge object (sympy on ``2^{2^{40}}``) gets a
``MemoryError``, one counted error, instead of growing until the machine swaps.

The built-in methods ("dapo", "math_verify", "synthetic_arith", "synthetic_chain", "reasoning_gym") are
registered by importing this module, so workers used on their own know them.

If anything escapes ``score_batch`` (Ctrl-C, a failed worker start), every worker that still owed
answers is killed and replaced before the exception propagates, and answers carry the batch's sequence
number, so a later batch never reads an earlier batch's answers.
"""
from __future__ import annotations

import collections
import dataclasses
import pickle
import subprocess
import sys
import time
from multiprocessing.connection import wait
from typing import Callable, Sequence

from megatron_credit.rewards import math as _builtin_methods  # noqa: F401  (registers the built-in methods)
from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, incorrect, method_for_data_source
from megatron_credit.rewards.verifier_worker import IMPORTED, READY

_START_TIMEOUT_S = 120.0  # a worker start is imports + one warm-up call; generous for loaded machines
IMPORT_GRACE_S = 60.0
"""Added to the first item's deadline of a chunk that names a verifier module the worker has not imported
yet, until the worker says the imports are done (``verifier_worker.IMPORTED``): a task library's import
(reasoning-gym: 1.4 s on a quiet machine, several under load) must not count as an item's timeout."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardItem:
    """One response to score."""

    response: str
    """The decoded response (without the prompt)."""
    ground_truth: str
    """The dataset's ground-truth answer."""
    data_source: str = "math_dapo"
    """Selects the method through ``VERIFIER_BY_DATA_SOURCE`` unless ``method`` is given."""
    method: str | None = None
    """Explicit ``REWARD_FNS`` name; overrides ``data_source``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifierWorkersConfig:
    """Number and limits of the verifier worker processes."""

    num_workers: int = 2
    """Worker processes."""
    timeout_s: float = 10.0
    """Per-item deadline in seconds; a worker past it is killed and replaced."""
    chunk_size: int = 16
    """Most items sent to a worker per message (amortises pipe overhead; the deadline stays per item);
    never more than an even share of the pending items, see the module docstring."""
    memory_limit_bytes: int | None = 4 * 1024**3
    """Address-space limit of each worker process (``RLIMIT_AS``); None for no limit."""
    batch_timeout_s: float | None = None
    """Deadline of one ``score_batch`` call in seconds, from its first item sent (worker start-up excluded):
    items still unscored then count as timeouts (their workers are replaced), so a batch of hostile items
    costs at most this; None: per-item deadlines only."""

    def __post_init__(self):
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 or None, got {self.batch_timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 256 * 1024**2:
            raise ValueError(f"memory_limit_bytes must be None or >= 256 MiB (the verifiers' imports need about "
                             f"that), got {self.memory_limit_bytes}")


class _Worker:
    """One worker process, its pipe, the item indices it still owes, and its deadlines."""

    def __init__(self, memory_limit_bytes: int | None):
        from megatron_credit.lifetime import start_worker

        self.proc, self.conn = start_worker("megatron_credit.rewards.verifier_worker", str(memory_limit_bytes or 0))
        self.owed: collections.deque[int] = collections.deque()
        self.deadline = float("inf")
        """When the item ``owed[0]`` times out (inf while idle)."""
        self.ready = False
        self.start_deadline = time.monotonic() + _START_TIMEOUT_S
        self.modules: set[str] = set()
        """The verifier modules sent to this worker so far (it has imported them, or failed to)."""

    def poll_ready(self, timeout: float = 0.0) -> bool:
        """Whether the worker has reported ready (waiting up to ``timeout`` s for it).

        Raises RuntimeError (after killing it) if it exited during start-up or missed the start deadline.
        """
        if self.ready:
            return True
        try:
            if self.conn.poll(timeout):
                message = self.conn.recv()
                if message != READY:
                    raise RuntimeError(f"reward worker sent {message!r} instead of {READY!r}")
                self.ready = True
                return True
        except (EOFError, OSError):
            try:
                code = self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            raise RuntimeError(
                f"reward worker (pid {self.proc.pid}) exited during start-up with exit code {code}; "
                "its traceback is on stderr"
            ) from None
        if time.monotonic() > self.start_deadline:
            self.kill()
            raise RuntimeError(f"reward worker did not start within {_START_TIMEOUT_S:.0f} s")
        return False

    def wait_ready(self) -> None:
        """Block until the worker has warmed up (RuntimeError if it dies or misses the start deadline)."""
        while not self.poll_ready(max(0.0, self.start_deadline - time.monotonic()) + 0.01):
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process, reap it and close the pipe (idempotent)."""
        from megatron_credit.lifetime import kill_and_reap

        kill_and_reap(self.proc, self.conn)


class VerifierWorkers:
    """Score batches of ``RewardItem`` in killable worker processes (see the module docstring).

    Use as a context manager, or call ``close()``. Not thread-safe: one ``score_batch`` at a time.
    """

    def __init__(self, config: VerifierWorkersConfig = VerifierWorkersConfig()):
        self.config = config
        self.restarts = 0
        self.last_errors: list[str] = []
        """Messages of the verifier exceptions of the last ``score_batch`` (for logs)."""
        self._seq = 0
        self._refs: dict[str, tuple[str, str]] = {}  # method -> (module, qualname), checked once
        self._workers: list[_Worker] = []
        try:  # started together, awaited together; never leak the started ones if one fails
            for _ in range(config.num_workers):
                self._workers.append(_Worker(config.memory_limit_bytes))
            for w in self._workers:
                w.wait_ready()
        except BaseException:
            for w in self._workers:
                w.kill()
            self._workers = []
            raise

    def __enter__(self) -> "VerifierWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and benchmarks)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers (politely, then by force)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            try:
                w.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers = []

    def score_batch(self, items: Sequence[RewardItem]) -> tuple[list[RewardRecord], dict[str, float]]:
        """Score ``items``; returns records in input order and metrics.

        Metrics: ``verifier/items``, ``/timeouts``, ``/errors``, ``/restarts`` (this batch),
        ``/bad_ground_truths`` (ground truths the verifier could not parse), ``/seconds``,
        ``/accuracy`` (fraction correct).
        """
        if not self._workers:
            raise RuntimeError("VerifierWorkers is closed")
        start, restarts_before = time.perf_counter(), self.restarts
        self.last_errors = []
        tasks = [(i, *self._reference(it), it.response, it.ground_truth) for i, it in enumerate(items)]
        self._seq += 1
        results: list[RewardRecord | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        counts = {"timeout": 0, "error": 0}
        done = 0
        batch_deadline = float("inf")  # set once the first item is sent: worker start-up never counts
        try:
            while done < len(tasks):
                if not self._workers:
                    raise RuntimeError("VerifierWorkers has no workers left (a replacement failed to start)")
                if time.monotonic() > batch_deadline:
                    done += self._fail_all(results, pending, counts)
                    break
                self._dispatch(tasks, pending)
                started = any(w.owed for w in self._workers)
                if batch_deadline == float("inf") and self.config.batch_timeout_s and started:
                    batch_deadline = time.monotonic() + self.config.batch_timeout_s
                waiting = [w for w in self._workers if w.owed or not w.ready]
                until = min([w.deadline for w in waiting if w.owed] +
                            [w.start_deadline for w in waiting if not w.ready] + [batch_deadline])
                wait([w.conn for w in waiting], timeout=max(0.0, until - time.monotonic()) + 0.001)
                # Read everything that has arrived, from every worker, before judging any deadline:
                # an answer that sits unread because the parent was busy is not a timeout.
                for w in list(self._workers):
                    if not w.ready:
                        w.poll_ready()  # a replacement that died or missed its start deadline raises
                    elif w.owed:
                        done += self._collect(w, results, pending, counts)
                for w in list(self._workers):
                    if w.owed and time.monotonic() > w.deadline:
                        done += self._collect(w, results, pending, counts)  # arrived while we were busy
                        if w.owed and time.monotonic() > w.deadline:
                            done += self._fail_current(w, results, pending, counts, status="timeout")
        except BaseException:
            self._abandon_owed()
            raise
        metrics = {
            "verifier/items": float(len(tasks)),
            "verifier/timeouts": float(counts["timeout"]),
            "verifier/errors": float(counts["error"]),
            "verifier/restarts": float(self.restarts - restarts_before),
            "verifier/bad_ground_truths": float(sum(r.status == "bad_ground_truth" for r in results)),
            "verifier/seconds": time.perf_counter() - start,
            "verifier/accuracy": sum(r.correct for r in results) / max(len(results), 1),
        }
        return results, metrics  # type: ignore[return-value]  (all filled: done == len(tasks))

    def _reference(self, item: RewardItem) -> tuple[str, str]:
        """``(module, qualname)`` of an item's verifier, checked once per method (ValueError if not)."""
        method = item.method if item.method is not None else method_for_data_source(item.data_source)
        ref = self._refs.get(method)
        if ref is None:
            ref = self._refs[method] = _reference(method, REWARD_FNS.get(method))
        return ref

    def _dispatch(self, tasks: list[tuple], pending: collections.deque[int]) -> None:
        """Give each ready, idle worker the next chunk of pending items."""
        for k, w in enumerate(self._workers):
            if w.owed or not w.ready or not pending:
                continue
            if not w.alive():  # died while idle: replace it (in the background) before giving it work
                self._replace(w)
                continue
            share = -(-len(pending) // len(self._workers))  # ceil: spread a small batch over every worker
            n = min(self.config.chunk_size, share)
            chunk = [pending.popleft() for _ in range(n)]
            w.owed.extend(chunk)  # before send: if send raises, the handler knows w owes answers
            new = {tasks[i][1] for i in chunk} - w.modules
            w.modules |= new
            w.deadline = time.monotonic() + self.config.timeout_s + (IMPORT_GRACE_S if new else 0.0)
            try:
                w.conn.send((self._seq, [tasks[i] for i in chunk]))
            except (OSError, ValueError):  # died after the check: nothing was attempted, re-queue
                pending.extendleft(reversed(chunk))
                w.owed.clear()
                self._replace(w)

    def _collect(self, w: _Worker, results: list, pending: collections.deque[int], counts: dict) -> int:
        """Read every answer ``w`` has sent; returns how many items finished."""
        finished = 0
        try:
            while w.owed and w.conn.poll():
                seq, idx, ok, payload = w.conn.recv()
                if seq != self._seq:
                    continue  # an earlier batch's answer (cannot happen after _abandon_owed; belt and braces)
                if idx == IMPORTED:  # the chunk's imports are done: its first item's own deadline starts
                    w.deadline = time.monotonic() + self.config.timeout_s
                    continue
                assert idx == w.owed[0], "workers answer their chunk in order"
                w.owed.popleft()
                if ok:
                    results[idx] = payload
                else:
                    results[idx] = incorrect(status="error")
                    counts["error"] += 1
                    self.last_errors.append(f"item {idx}: {payload}")
                finished += 1
                w.deadline = time.monotonic() + self.config.timeout_s if w.owed else float("inf")
        except (EOFError, OSError):  # the worker died (crash, OOM kill) in the middle of an item
            finished += self._fail_current(w, results, pending, counts, status="error")
        return finished

    def _fail_current(
        self, w: _Worker, results: list, pending: collections.deque[int], counts: dict, *, status: str
    ) -> int:
        """Score ``w``'s current item as failed, re-queue the rest of its chunk, replace ``w``."""
        idx = w.owed.popleft()
        results[idx] = incorrect(status=status)  # type: ignore[arg-type]
        counts[status] += 1
        pending.extendleft(reversed(w.owed))
        w.owed.clear()
        self._replace(w)
        return 1

    def _fail_all(self, results: list, pending: collections.deque[int], counts: dict) -> int:
        """The batch deadline passed: every unscored item is a timeout; workers owing answers are replaced."""
        failed = 0
        for w in list(self._workers):
            if w.owed:
                while w.owed:
                    results[w.owed.popleft()] = incorrect(status="timeout")  # type: ignore[arg-type]
                    failed += 1
                self._replace(w)
        while pending:
            results[pending.popleft()] = incorrect(status="timeout")  # type: ignore[arg-type]
            failed += 1
        counts["timeout"] += failed
        return failed

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and start its replacement without waiting for it (it gets work once ready)."""
        w.kill()
        self._workers[self._workers.index(w)] = self._start_worker()

    def _start_worker(self) -> _Worker:
        """A fresh worker, still starting (a replacement counts as a restart)."""
        w = _Worker(self.config.memory_limit_bytes)
        self.restarts += 1
        return w

    def _abandon_owed(self) -> None:
        """After an escaped exception: replace every worker that still owes answers.

        Its answers may still arrive; a fresh process is the only way to be sure they never reach a
        later batch (the batch sequence number is the second guard).
        """
        for w in list(self._workers):
            if w.owed:
                w.owed.clear()
                try:
                    self._replace(w)
                except BaseException:  # noqa: BLE001  (cannot start one now: drop it, keep the first error)
                    self._workers.remove(w)


def _reference(method: str, fn: Callable) -> tuple[str, str]:
    """How a worker finds ``fn``: ``(module, qualname)``; ValueError naming ``method`` if it cannot."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    problem = None
    if not isinstance(module, str) or not isinstance(qualname, str):
        problem = "it has no module-level name (a callable object or functools.partial?)"
    elif module == "__main__" or "<" in qualname:
        problem = f"{module}.{qualname} is defined in __main__, a lambda or a closure"
    else:
        try:
            pickle.dumps(fn)  # by-reference pickling checks that module.qualname is fn itself
        except Exception as exc:  # noqa: BLE001
            problem = f"it does not pickle by reference ({type(exc).__name__}: {exc})"
    if problem is not None:
        raise ValueError(
            f"reward method {method!r} cannot be sent to a reward worker: {problem}; register a function "
            "defined at module level of an importable module"
        )
    from megatron_credit.plugins import PLUGIN_MODULE_PREFIX

    path = getattr(sys.modules.get(module), "__file__", None)
    if module.startswith(PLUGIN_MODULE_PREFIX) and path:  # a --plugin file: a worker loads it by its path
        return path, qualname
    return module, qualname
