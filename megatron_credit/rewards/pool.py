"""A reward process pool whose workers can be killed: a hung verifier never stops training.

``math-verify`` can hang on hostile input (sympy on a pathological expression), and its signal-based
timeout works only in a main thread. ``concurrent.futures.ProcessPoolExecutor`` cannot kill one hung
worker (its only remedy is to break the whole pool). So this pool owns its processes: each worker has a
private pipe, receives a chunk of items, and answers item by item. The parent waits on all pipes with a
deadline per *item* (the clock restarts at each answer); when a worker misses its deadline it is killed
(SIGKILL) and replaced, the item it was on is scored as a timeout, and the rest of its chunk is
re-queued. A verifier that raises, or a worker that dies, scores that item as an error. Timeouts and
errors score as incorrect (``score=-1, correct=False``), carry ``status="timeout"``/``"error"`` and are
counted in the metrics; ``score_batch`` itself never raises for them.

Verifier callables are sent to workers by reference (pickled as module + name), so a function
registered in ``REWARD_FNS`` from any importable module (a test file, a plug-in) works in the pool.

Workers start with the "forkserver" method by default: the server process imports the verifiers
(and sympy, ~1 s) once and each worker, including a replacement after a kill, is a cheap fork of it,
never a fork of the trainer (which holds CUDA contexts and process-group threads). A new worker makes
one warm-up call before it reports ready, and the parent waits for that, so start-up cost never counts
against an item's deadline.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import signal
import time
from typing import Any, Callable, Sequence

from megatron_credit.rewards import math as _math  # noqa: F401  (registers the built-in methods)
from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, incorrect, method_for_data_source

_PRELOAD = ["megatron_credit.rewards.math", "math_verify"]
_READY = "ready"
_START_TIMEOUT_S = 120.0  # a worker start is imports + one warm-up call; generous for loaded machines


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardItem:
    """One response to score."""

    response: str
    """The decoded response (without the prompt)."""
    ground_truth: str
    """The dataset's ground-truth answer."""
    data_source: str = "math_dapo"
    """Selects the method through ``DATA_SOURCES`` unless ``method`` is given."""
    method: str | None = None
    """Explicit ``REWARD_FNS`` name; overrides ``data_source``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardPoolConfig:
    """Size and limits of the reward pool."""

    num_workers: int = 2
    """Worker processes."""
    timeout_s: float = 10.0
    """Per-item deadline in seconds; a worker past it is killed and replaced."""
    chunk_size: int = 16
    """Items sent to a worker per message (amortises pipe overhead; the deadline stays per item)."""
    start_method: str = "forkserver"
    """multiprocessing start method: "forkserver" (default), "spawn" or "fork"."""

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"start_method must be forkserver, spawn or fork, got {self.start_method!r}")


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """Worker loop: receive ``[(idx, fn, response, gt), ...]``, answer ``(idx, ok, payload)`` per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle, then close()
    # math-verify builds its grammars and regexes on first use (~0.1 s, seconds on a loaded machine);
    # pay that before reporting ready, so that it never counts against the first item's deadline.
    try:
        _math.score_math_verify("\\boxed{\\frac{1}{2}}", "0.5")
    except Exception:  # noqa: BLE001  (a broken math-verify install shows up as per-item errors)
        pass
    conn.send(_READY)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for idx, fn, response, ground_truth in chunk:
            try:
                record = fn(response, ground_truth)
                if not isinstance(record, RewardRecord):
                    raise TypeError(f"reward fn returned {type(record).__name__}, not RewardRecord")
                conn.send((idx, True, record))
            except Exception as exc:  # noqa: BLE001  (any verifier failure is one failed item)
                conn.send((idx, False, f"{type(exc).__name__}: {exc}"))


class _Worker:
    """One worker process, its pipe, the item indices it still owes, and its current deadline."""

    def __init__(self, ctx: Any):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.owed: collections.deque[int] = collections.deque()
        self.deadline = float("inf")

    def wait_ready(self) -> None:
        """Block until the worker has warmed up (deadlines only start once it is ready)."""
        try:
            ready = self.conn.poll(_START_TIMEOUT_S) and self.conn.recv() == _READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.proc.kill()
            raise RuntimeError(f"reward worker did not start within {_START_TIMEOUT_S:.0f} s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardPool:
    """Score batches of ``RewardItem`` in killable worker processes (see the module docstring).

    Use as a context manager, or call ``close()``. Not thread-safe: one ``score_batch`` at a time.
    """

    def __init__(self, config: RewardPoolConfig = RewardPoolConfig()):
        self.config = config
        self._ctx = multiprocessing.get_context(config.start_method)
        if config.start_method == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers = [_Worker(self._ctx) for _ in range(config.num_workers)]
        for w in self._workers:  # started together, awaited together
            w.wait_ready()
        self.restarts = 0
        self.last_errors: list[str] = []
        """Messages of the verifier exceptions of the last ``score_batch`` (for logs)."""

    def __enter__(self) -> "RewardPool":
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
            w.proc.join(timeout=2.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
        self._workers = []

    def score_batch(self, items: Sequence[RewardItem]) -> tuple[list[RewardRecord], dict[str, float]]:
        """Score ``items``; returns records in input order and metrics.

        Metrics: ``reward_pool/items``, ``/timeouts``, ``/errors``, ``/restarts`` (this batch),
        ``/seconds``, ``/accuracy`` (fraction correct).
        """
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        start, restarts_before = time.perf_counter(), self.restarts
        self.last_errors = []
        tasks = [(i, _resolve(item), item.response, item.ground_truth) for i, item in enumerate(items)]
        results: list[RewardRecord | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        counts = {"timeout": 0, "error": 0}
        done = 0
        while done < len(tasks):
            self._dispatch(tasks, pending)
            busy = [w for w in self._workers if w.owed]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=wait_s)
            for w in busy:
                if w.conn in ready:
                    done += self._collect(w, results, pending, counts)
                if w.owed and time.monotonic() > w.deadline:
                    done += self._fail_current(w, results, pending, counts, status="timeout")
        metrics = {
            "reward_pool/items": float(len(tasks)),
            "reward_pool/timeouts": float(counts["timeout"]),
            "reward_pool/errors": float(counts["error"]),
            "reward_pool/restarts": float(self.restarts - restarts_before),
            "reward_pool/seconds": time.perf_counter() - start,
            "reward_pool/accuracy": sum(r.correct for r in results) / max(len(results), 1),
        }
        return results, metrics  # type: ignore[return-value]  (all filled: done == len(tasks))

    def _dispatch(self, tasks: list[tuple], pending: collections.deque[int]) -> None:
        """Give each idle worker the next chunk of pending items."""
        for k, w in enumerate(self._workers):
            if w.owed or not pending:
                continue
            if not w.proc.is_alive():  # died while idle: replace it before giving it work
                w.kill()
                w = self._workers[k] = self._start_worker()
            n = min(self.config.chunk_size, len(pending))
            chunk = [pending.popleft() for _ in range(n)]
            w.owed.extend(chunk)
            w.deadline = time.monotonic() + self.config.timeout_s
            try:
                w.conn.send([tasks[i] for i in chunk])
            except (OSError, ValueError):
                pass  # a dead worker: its pipe reports EOF on the next wait and it is replaced

    def _collect(self, w: _Worker, results: list, pending: collections.deque[int], counts: dict) -> int:
        """Read every answer ``w`` has sent; returns how many items finished."""
        finished = 0
        try:
            while w.owed and w.conn.poll():
                idx, ok, payload = w.conn.recv()
                assert idx == w.owed[0], "workers answer their chunk in order"
                w.owed.popleft()
                if ok:
                    results[idx] = payload
                else:
                    results[idx] = incorrect(status="error")
                    counts["error"] += 1
                    self.last_errors.append(f"item {idx}: {payload}")
                finished += 1
                w.deadline = time.monotonic() + self.config.timeout_s
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
        w.kill()
        self._workers[self._workers.index(w)] = self._start_worker()
        return 1

    def _start_worker(self) -> _Worker:
        """A fresh, warmed-up worker (a replacement counts as a restart)."""
        w = _Worker(self._ctx)
        w.wait_ready()
        self.restarts += 1
        return w


def _resolve(item: RewardItem) -> Callable[[str, str], RewardRecord]:
    """The verifier callable of an item (raises ValueError naming valid methods/data sources)."""
    method = item.method if item.method is not None else method_for_data_source(item.data_source)
    return REWARD_FNS.get(method)
