"""The channels between the trainer's ranks and the rollout pool's (``rollout.ranks: N``).

A launch of ``W`` ranks with a pool: ranks ``0 .. T - 1`` (``T = W - N``) train (their default process group
and megatron's groups hold only them), ranks ``T .. W - 1`` are the pool, ``N / rollout_tp`` engines, engine
``e`` led by rank ``T + e * rollout_tp`` (its other ranks give the engine their devices and wait). Every
channel is built from the launch's rendezvous store (:class:`megatron_credit.distributed.Job`):

| channel | between | carries |
| --- | --- | --- |
| the store (keys under ``mc/``) | every rank | small facts: where a run starts, validation requests and results, each batch's facts, progress and life beats, an error line, stop |
| ``weights``: one 2-rank group per engine | trainer rank ``e % T`` and engine ``e``'s leader | each version's HF-named buckets (nccl on GPU: device to device, no host copy; gloo on CPU) |
| ``samples``: one gloo group of the world | engine leaders -> the trainer's replica heads | each group once, as bytes of tensors (``rollout/wire.py``) |
| ``pool``: one gloo group of the engine leaders | engines | a draw's verdicts and versions, the validation sums |

Waits on the trainer side time out on silence, not on total time: the engines beat at every draw and every
few decode steps (``hb/<e>``), every pool rank beats while it lives (``alive/<rank>``), and a wait stops the
run with one line when no beat came for ``rollout.wait_timeout_s`` (progress) or :attr:`Bridge.life_s`
(life: :data:`GONE_S`, or less when ``rollout.wait_timeout_s`` is shorter). The exchanges with one pool rank
(a version's weights, a batch's samples) are waited on the same way: a rank that stops living in the middle
(killed, stopped with SIGSTOP, its machine lost) is named within ``life_s``, not after the process group's
timeout (hours). Groups whose exchange was abandoned so are never destroyed (their destructor would wait for
the stopped peer); the others are shut down at :meth:`Bridge.close`.
Trainer rank 0 beats its life too, and a pool rank stops when it has not for :data:`GONE_S`: a trainer that
dies where no launcher ends the pool (a pool rank on another node, a store hosted elsewhere) never leaves
it waiting for weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import threading
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_credit.cli import RunStopped
from megatron_credit.sources.bucket_bytes import pack
from megatron_credit.sources.staging import StagingRing

POLL_S = 0.25
"""How often a wait looks at the store."""
BEAT_S = 1.0
"""The most often an engine records progress (``hb/<e>``)."""
ALIVE_S = 2.0
"""How often every pool rank (and trainer rank 0) records that it lives."""
GONE_S = 30.0
"""A rank that recorded no life for this long is gone (killed, or its machine lost): the run stops naming it."""


@dataclasses.dataclass(frozen=True)
class PoolRanks:
    """Who is who in a launch of ``world`` ranks whose last ``pool`` ranks are the rollout pool.

    >>> ranks = PoolRanks(world=6, pool=4, rollout_tp=2)
    >>> ranks.trainer_world, ranks.engines, [ranks.leader(e) for e in range(2)], [ranks.sender(e) for e in range(2)]
    (2, 2, [2, 4], [0, 1])
    >>> ranks.engine_of(5), ranks.engine_of(4)
    (1, 1)
    """

    world: int
    pool: int
    rollout_tp: int = 1

    def __post_init__(self) -> None:
        if self.pool < 1 or self.pool >= self.world:
            raise ValueError(f"rollout.ranks={self.pool} must leave at least one trainer rank in a world of "
                             f"{self.world} (torchrun --nproc-per-node / --nnodes)")
        if self.pool % self.rollout_tp:
            raise ValueError(f"rollout.ranks={self.pool} must be a multiple of rollout.engine_options."
                             f"tensor_parallel_size={self.rollout_tp}: each engine takes that many ranks")

    @property
    def trainer_world(self) -> int:
        return self.world - self.pool

    @property
    def engines(self) -> int:
        return self.pool // self.rollout_tp

    def leader(self, e: int) -> int:
        """The global rank that runs engine ``e``."""
        return self.trainer_world + e * self.rollout_tp

    def sender(self, e: int) -> int:
        """The trainer rank that sends engine ``e`` its weights (the buckets are whole on every trainer rank:
        the engines' sends are spread over them)."""
        return e % self.trainer_world

    def engine_of(self, rank: int) -> int:
        return (rank - self.trainer_world) // self.rollout_tp


def _bcast(group, tensor: torch.Tensor, root: int, *, wait: bool = True):
    """Broadcast ``tensor`` from ``root`` over ``group``; waits for it, or returns its work (``wait=False``)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    work = group.broadcast([tensor], opts)
    if not wait:
        return work
    work.wait()
    return None


class Bridge:
    """This rank's ends of the channels (module docstring). Every rank of the launch builds one, at
    start-up (building a group waits for its other ranks)."""

    def __init__(self, job, *, rollout_tp: int, device: torch.device, timeout_s: float,
                 wait_timeout_s: Optional[float] = None):
        """``timeout_s``: the process groups' timeout (``distributed.timeout_s``); ``wait_timeout_s``: the
        trainer's silence timeout (``rollout.wait_timeout_s``), which shortens :attr:`life_s`."""
        self.job, self.rank = job, job.rank
        self.wait_timeout_s = wait_timeout_s
        self.ranks = PoolRanks(world=job.world_size, pool=job.pool_ranks, rollout_tp=rollout_tp)
        self.store = dist.PrefixStore("mc", job.store)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        ranks = self.ranks
        self.samples = dist.ProcessGroupGloo(dist.PrefixStore("samples", job.store), self.rank, ranks.world,
                                             self.timeout)
        self.is_trainer = self.rank < ranks.trainer_world
        self.engine = None if self.is_trainer else ranks.engine_of(self.rank)
        self.is_leader = not self.is_trainer and ranks.leader(self.engine) == self.rank
        self.weights: dict[int, Any] = {}  # engine -> its 2-rank weights group (this rank: sender or leader)
        for e in range(ranks.engines):
            if self.rank in (ranks.sender(e), ranks.leader(e)):
                self.weights[e] = self._group(f"weights/{e}", 0 if self.rank == ranks.sender(e) else 1, 2,
                                              nccl=device.type == "cuda")
        leaders = [ranks.leader(e) for e in range(ranks.engines)]
        self.pool = (self._group("pool", leaders.index(self.rank), len(leaders), nccl=False)
                     if self.is_leader and ranks.engines > 1 else None)
        self.transfers = 0  # weight versions sent (trainer) / received (engine leader): the store keys' index
        # an engine leader's received versions, in host memory pinned on a GPU (sources/staging.py)
        self.ring = StagingRing(pin=device.type == "cuda") if self.is_leader else None
        self._pending: list = []  # sample sends in flight (and their tensors)
        self._alive_stop = threading.Event()
        self._alive: Optional[threading.Thread] = None
        self._life: dict[int, tuple[int, float]] = {}  # rank -> (its life count, when it last changed)
        self.wedged = False  # an exchange with a stopped peer was abandoned: its work is still pending

    @property
    def life_s(self) -> float:
        """How long a pool rank may record no life before the trainer names it: :data:`GONE_S`, or
        ``rollout.wait_timeout_s`` when shorter (but at least three beats: the life beat is a thread's).

        >>> b = Bridge.__new__(Bridge)
        >>> [(setattr(b, "wait_timeout_s", w), b.life_s)[1] for w in (None, 1800, 10, 1)]
        [30.0, 30.0, 10, 6.0]
        """
        if self.wait_timeout_s is None:
            return GONE_S
        return min(GONE_S, max(3 * ALIVE_S, self.wait_timeout_s))

    def _group(self, name: str, rank: int, size: int, *, nccl: bool):
        store = dist.PrefixStore(name, self.job.store)
        if nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, self.timeout)

    # -- the store ----------------------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        """``key``'s value, or None while it is unset."""
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def count(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    def stopping(self) -> bool:
        return self.store.check(["stop"])

    def stop(self) -> None:
        """Tell the pool the run ends (every pool rank exits at its next look)."""
        self.store.set("stop", "1")

    def fail(self, line: str) -> None:
        """A pool rank's error, for the trainer to report (the first one counts)."""
        if not self.store.check(["error"]):
            self.store.set("error", json.dumps(f"rank {self.rank}: {line}"))

    def gone(self, rank: int, after_s: Optional[float] = None) -> bool:
        """Whether ``rank`` has recorded no life for ``after_s`` seconds (default :data:`GONE_S`) since it
        first did (a rank not yet living is not gone); each call reads its count once."""
        n, now = self.count(f"alive/{rank}"), time.monotonic()
        seen = self._life.get(rank)
        if seen is None or seen[0] != n:
            self._life[rank] = (n, now)
            return False
        return bool(n) and now - seen[1] > (GONE_S if after_s is None else after_s)

    def role(self, rank: int) -> str:
        """What pool rank ``rank`` is, for a line naming it.

        >>> b = Bridge.__new__(Bridge)
        >>> b.ranks = PoolRanks(world=6, pool=4, rollout_tp=2)
        >>> b.role(4), b.role(5)
        ("engine 1's leader", 'a worker of engine 1')
        """
        e = self.ranks.engine_of(rank)
        return f"engine {e}'s leader" if self.ranks.leader(e) == rank else f"a worker of engine {e}"

    def gone_line(self, rank: int, what: str, seconds: Optional[float] = None) -> str:
        """The line naming pool rank ``rank``, which recorded no life for ``seconds`` (default :attr:`life_s`)."""
        return (f"rollout pool rank {rank} ({self.role(rank)}) is gone: no sign of life for "
                f"{self.life_s if seconds is None else round(seconds):g} s while {what} (killed, stopped by a "
                "signal, or its machine lost)")

    def start_alive(self) -> None:
        """Record this rank's life every :data:`ALIVE_S` seconds, from a thread, until :meth:`close`.

        The thread holds the store and nothing else of the bridge, and :meth:`close` joins it: a daemon
        thread still inside a torch call that released the GIL (a store read, or a process group's
        destructor, which torch runs with the GIL released) when the interpreter finalizes is ended by
        ``pthread_exit`` inside that C++ frame, and the process aborts ("terminate called without an active
        exception", SIGABRT) after the run has finished. Were the bridge's last reference this thread's, its
        process groups would be destroyed here, racing the main thread's exit."""
        store, key, stop = self.store, f"alive/{self.rank}", self._alive_stop

        def beat():
            try:
                while True:
                    store.add(key, 1)
                    if stop.wait(ALIVE_S):
                        return
            except Exception:  # noqa: BLE001  (the store is gone: the launch is ending)
                return
        self._alive = threading.Thread(target=beat, name="pool-alive", daemon=True)
        self._alive.start()

    # -- weights: trainer side ----------------------------------------------------------------------
    def send_weights(self, version: int, buckets: Iterable) -> int:
        """Every trainer rank: stream ``buckets`` (their gathers are collectives) and send each to the engines
        this rank serves; returns the bytes this rank sent. The store announces the version first, so the
        engine's receiving thread posts its receives."""
        mine = sorted(self.weights)
        seq = self.transfers
        self.transfers += 1
        for e in mine:
            self.put(f"w/{e}/{seq}", version)
        sent = 0
        for bucket in buckets:
            if not mine:
                continue
            meta, flat = pack(bucket, self.device)
            m = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)
            head = torch.tensor([m.numel(), flat.numel()], dtype=torch.int64, device=self.device)
            for e in mine:
                for t in (head, m, flat):
                    self._watch(_bcast(self.weights[e], t, 0, wait=False), self.ranks.leader(e),
                                f"sending version {version}'s weights")
            sent += flat.numel() * len(mine)
        end = torch.zeros(2, dtype=torch.int64, device=self.device)
        for e in mine:
            self._watch(_bcast(self.weights[e], end, 0, wait=False), self.ranks.leader(e),
                        f"sending version {version}'s weights")
        return sent

    @staticmethod
    @contextlib.contextmanager
    def _peer(rank: int, what: str):
        """A failed exchange with pool rank ``rank`` (gone: its connection closed, or timed out) stops the run
        with one line naming it."""
        try:
            yield
        except RunStopped:
            raise
        except RuntimeError as exc:
            raise RunStopped(f"rollout pool rank {rank} failed while {what}: {' '.join(str(exc).split())[:300]}") from exc

    def _watch(self, work, peer: int, what: str) -> None:
        """Wait for ``work``, an exchange with pool rank ``peer``, while watching the pool: the run stops with
        one line when a pool rank reported an error or ``peer`` recorded no life for :attr:`life_s` (its own
        failure, a closed connection, is named by :meth:`_peer`). Polls with a pause of at most an eighth of
        the time waited so far (a bucket's transfer is not slowed by more than that), at most ``POLL_S``.

        A collective's work (a broadcast) says when it completed; a gloo receive's says so only from its
        ``wait``, which cannot be retried after a timeout: a thread waits for it."""
        failed: list = []
        done = work.start(failed) if isinstance(work, _Waited) else work.is_completed
        t0 = looked = time.monotonic()
        with self._peer(peer, what):
            while not done():
                now = time.monotonic()
                if now - looked >= POLL_S:
                    looked = now
                    line = None
                    if self.store.check(["error"]):
                        line = f"the rollout pool failed ({what}): {self.get('error')}"
                    elif self.gone(peer, self.life_s):
                        line = self.gone_line(peer, what)
                    if line is not None:
                        self.wedged = True
                        raise RunStopped(line)
                time.sleep(min(POLL_S, 2e-4 + (now - t0) / 8))
            if failed:
                raise failed[0]
            if not isinstance(work, _Waited):
                work.wait()

    # -- weights: engine side -----------------------------------------------------------------------
    def receive_weights(self, stop: Callable[[], bool]) -> Optional[int]:
        """Engine leader: receive the next version sent to this engine into :attr:`ring` and stage it (an older
        staged version is dropped); returns its version, None when ``stop()`` turned true while waiting for one
        (or for a free bank of the ring). Each bucket arrives on this rank's device and, on a GPU, is copied
        into its pinned host chunk (a whole version on the device would sit beside the engine's weights and KV
        cache: 61 GiB at 32B); the engine's ``update_weights`` puts each bucket back on the device as it loads
        (:meth:`StagingRing.take`). On the CPU the bucket is received into its chunk directly."""
        key = f"w/{self.engine}/{self.transfers}"
        while not self.store.check([key]):
            if stop():
                return None
            time.sleep(POLL_S)
        bank = self.ring.begin(stop)
        if bank is None:
            return None
        try:
            version = self.get(key)
            self.store.delete_key(key)
            self.transfers += 1
            group, buckets = self.weights[self.engine], []
            while True:
                head = torch.empty(2, dtype=torch.int64, device=self.device)
                _bcast(group, head, 0)
                n_meta, n_flat = (int(x) for x in head.tolist())
                if n_meta == 0:
                    break
                m = torch.empty(n_meta, dtype=torch.uint8, device=self.device)
                _bcast(group, m, 0)
                chunk = self.ring.chunk(bank, len(buckets), n_flat)
                if self.device.type == "cpu":
                    _bcast(group, chunk, 0)
                else:  # the device holds one bucket at a time
                    flat = torch.empty(n_flat, dtype=torch.uint8, device=self.device)
                    _bcast(group, flat, 0)
                    chunk.copy_(flat)
                buckets.append((bytes(m.cpu().numpy()), n_flat))
        except BaseException:
            self.ring.abandon(bank)
            raise
        self.ring.stage(bank, version, buckets)
        return version

    # -- samples ------------------------------------------------------------------------------------
    def send_groups(self, step: int, by_head: dict[int, list]) -> None:
        """Engine leader: each trainer replica head (``by_head``: global rank -> ``[(k, group), ...]``, every
        head named, possibly with none) its groups of batch ``step``, as one message (size, then bytes);
        the sends complete while the engine goes on, when the trainer asks for the batch (the pool may run up
        to the staleness bound ahead, so several batches' sends can be in flight)."""
        from megatron_credit.rollout.wire import encode

        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
        for head, items in sorted(by_head.items()):
            buf = encode(items)
            size = torch.tensor([buf.numel()], dtype=torch.int64)
            self._pending.append((self.samples.send([size], head, 2 * step), size))
            if buf.numel():
                self._pending.append((self.samples.send([buf], head, 2 * step + 1), buf))

    def wait_sent(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def receive_groups(self, step: int) -> tuple[list, int]:
        """Replica head: batch ``step``'s groups from every engine leader, ``[(k, group), ...]`` in the order of
        ``k``, and the bytes received."""
        from megatron_credit.rollout.wire import decode

        got, nbytes = [], 0
        for e in range(self.ranks.engines):
            src = self.ranks.leader(e)
            size = torch.empty(1, dtype=torch.int64)
            what = f"receiving iteration {step}'s samples"
            self._watch(_Waited(self.samples.recv([size], src, 2 * step)), src, what)
            buf = torch.empty(int(size), dtype=torch.uint8)
            if int(size):
                self._watch(_Waited(self.samples.recv([buf], src, 2 * step + 1)), src, what)
            got += decode(buf) if buf.numel() else []
            nbytes += buf.numel()
        return sorted(got, key=lambda item: item[0]), nbytes

    # -- the pool's own collectives -----------------------------------------------------------------
    def pool_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the engines (in place; a float64 / int64 CPU tensor)."""
        if self.pool is not None:
            self.pool.allreduce([t]).wait()
        return t

    # -- waits --------------------------------------------------------------------------------------
    def wait_for(self, key: str, *, what: str, silence_s: float, spawned: Optional[list] = None) -> Any:
        """Trainer rank: ``key``'s value once set. Stops the run with one line when a pool rank reported an
        error, a process the entry point started for the pool exited, a pool rank recorded no life for
        :data:`GONE_S` s, or no engine recorded progress for ``silence_s`` s (``what``: what waited). Trainer
        rank 0 watches the beats and puts what it found under ``stopped`` for the others (so the store
        serves a few reads per rank and poll, not every beat for every trainer rank)."""
        ranks = self.ranks
        progress, last_progress = None, time.monotonic()
        while True:
            if self.store.check(["error"]):
                raise RunStopped(f"the rollout pool failed ({what}): {self.get('error')}")
            if self.store.check(["stopped"]):
                raise RunStopped(self.get("stopped"))
            value = self.get(key)
            if value is not None:
                return value
            if self.rank == 0:
                beats = [self.count(f"hb/{e}") for e in range(ranks.engines)]
                if beats != progress:
                    progress, last_progress = beats, time.monotonic()
                line = self._silent(what, spawned, time.monotonic() - last_progress, silence_s)
                if line is not None:
                    self.put("stopped", line)
                    raise RunStopped(line)
            time.sleep(POLL_S)

    def _silent(self, what: str, spawned, quiet_s: float, silence_s: float) -> Optional[str]:
        """Trainer rank 0: why the wait should end (one line), or None."""
        ranks = self.ranks
        for r, proc in enumerate(spawned or (), start=ranks.trainer_world):
            if proc.poll() is not None:
                return f"rollout pool rank {r} exited (code {proc.returncode}) while {what}"
        for r in range(ranks.trainer_world, ranks.world):
            if self.gone(r, self.life_s):
                return self.gone_line(r, what)
        if quiet_s > silence_s:
            now = time.monotonic()  # a silent pool with a rank whose life beats stopped too: that rank is named
            lifeless = {r: now - self._life[r][1] for r in range(ranks.trainer_world, ranks.world)
                        if self._life.get(r, (0,))[0]}
            stalled = [r for r, age in lifeless.items() if age > 2 * ALIVE_S]
            if stalled:
                return self.gone_line(stalled[0], what, seconds=lifeless[stalled[0]])
            return (f"{what}: the rollout pool made no progress for {silence_s:g} s "
                    "(rollout.wait_timeout_s; a draw or a few decode steps count)")
        return None

    def close(self) -> None:
        """Stop the life beat and wait for its thread to end (at most ``2 * ALIVE_S`` s: a store that does not
        answer a beat in that time is gone with its launch); then end the process groups: shut down when
        nothing is in flight, otherwise left alive to the process's end (:func:`_abandon`)."""
        self._alive_stop.set()
        if self._alive is not None:
            self._alive.join(timeout=2 * ALIVE_S)
            self._alive = None
        groups = [g for g in (self.samples, self.pool, *self.weights.values()) if g is not None]
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
        in_flight = self.wedged or bool(self._pending)
        for g in groups:
            if in_flight:
                _abandon(g)
            else:
                with contextlib.suppress(Exception):  # a peer already gone: nothing left to end
                    g.shutdown()
        self.samples, self.pool, self.weights, self._pending = None, None, {}, []


class _Waited:
    """A work whose completion only its ``wait`` tells (a gloo receive), waited for by a thread of its own.
    Abandoned (its peer stopped), the thread stays blocked in C with the GIL released until the process ends,
    which it does not hold (it is a daemon, and never takes the GIL again)."""

    def __init__(self, work):
        self.work = work

    def start(self, failed: list) -> Callable[[], bool]:
        finished = threading.Event()

        def wait():
            try:
                self.work.wait()
            except BaseException as exc:  # noqa: BLE001  (raised by the watching thread)
                failed.append(exc)
            finally:
                finished.set()
        threading.Thread(target=wait, name="pool-exchange", daemon=True).start()
        return finished.is_set


def _abandon(group) -> None:
    """Keep ``group`` alive until the process ends: its destructor would wait for work in flight with a peer
    that may never take it (stopped, or gone with its sends unread), holding the exit for the group's timeout;
    at the process's end the system closes its connections."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
