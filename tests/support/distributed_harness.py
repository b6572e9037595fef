"""A pool of spawned gloo workers that lives for one test module.

Each new Python process pays several seconds of imports (torch, megatron-core), so tests do not spawn
a process group per check. Instead a module-scoped fixture starts ``world_size`` workers once, each with
an initialised ``torch.distributed`` gloo group, and every check sends a module-level function to all of
them::

    @pytest.fixture(scope="module")
    def pool():
        with DistributedPool(world_size=2) as p:
            yield p

    def _check(x):                     # runs on every rank; must be importable (module level)
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_something(pool):
        assert pool.run(_check, 3) == [0, 3]

``run`` returns the per-rank results in rank order. An exception on any rank is re-raised in the test
with that rank's traceback; the pool is then torn down (other ranks may be stuck in a collective) and
restarted by the next ``run``.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - e.g. the port was taken after it was chosen: start() tries another
        results.put((rank, "init_err", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                results.put((rank, "ok", fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - forwarded to the test with its traceback
                results.put((rank, "err", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistributedPool:
    """``world_size`` spawned processes with a gloo process group, reused across checks."""

    def __init__(self, world_size: int, *, timeout: float = 600.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list = []
        self._tasks: list = []
        self._results = None

    def start(self, attempts: int = 3) -> None:
        """Spawn the ranks and wait until every one has joined the group. A port is free when chosen but may be
        taken by another process before rank 0 listens on it; then the ranks are ended and another port tried."""
        from tests.support import spawn_guard

        spawn_guard.require(("dist",), f"{self.world_size} gloo worker processes (DistributedPool)")
        for attempt in range(attempts):
            self._spawn()
            why = self._wait_ready()
            if why is None:
                return
            self.close()
            if attempt == attempts - 1:
                raise RuntimeError(f"the gloo ranks could not form a group in {attempts} tries:\n{why}")

    def _wait_ready(self) -> "str | None":
        """None once every rank joined the group; else the first failure's traceback."""
        ready = 0
        while ready < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                return f"no rank joined the group in {self.timeout}s"
            if status == "init_err":
                return value
            ready += 1
        return None

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results),
                        daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs, self._tasks, self._results = [], [], None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs:
            self.start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__}: no result from ranks "
                                   f"{sorted(set(range(self.world_size)) - set(out))} in {self.timeout}s")
            if status == "err":
                self.close()
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def __enter__(self) -> "DistributedPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def block_subgroup(size: int):
    """This rank's group among consecutive blocks of ``size`` ranks, and its rank in it.

    Call on every rank of the pool (``new_group`` is collective: every rank creates every block).
    """
    import torch.distributed as dist

    rank, mine = dist.get_rank(), None
    for start in range(0, dist.get_world_size(), size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine, rank % size


def load_balanced_shard(t: torch.Tensor, cp: int, r: int) -> torch.Tensor:
    """Rank ``r``'s share of ``t [B, T]`` in megatron's load-balanced CP chunk order: chunks r and 2cp-1-r.

    Written here, apart from ``megatron_credit.batch.context_parallel``, so that tests of code taking
    CP shards do not build their inputs with the code under test.
    """
    c = t.shape[1] // (2 * cp)
    return torch.cat([t[:, r * c:(r + 1) * c], t[:, (2 * cp - 1 - r) * c:(2 * cp - r) * c]], dim=1)


def pipeline_forward(model, ids: torch.Tensor, pos: torch.Tensor, attn_mask, *, hidden_size: int):
    """One no-grad forward of a megatron GPTModel over its PP stages (activations sent stage to stage) and
    TP ranks; returns the full-vocabulary logits ``[B, S, V]`` on the last stage, None on the others."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        if pp_rank > 0:
            hidden = torch.empty(s, b, hidden_size)
            dist.recv(hidden, src=ranks[pp_rank - 1], group=group)
            model.set_input_tensor(hidden)
        out = model(ids, pos, attn_mask)
        if pp_rank < pp - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1], group=group)
            return None
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)


def module_pool(world_size: int):
    """A module-scoped fixture: a :class:`DistributedPool` of ``world_size`` workers, started once for the
    module's tests. ``pool = module_pool(2)`` at module level; the fixture takes the name it is bound to
    (``pool``, ``pool2``, ...: ``tests/conftest.py`` finds the gloo-pool tests by that name)."""
    import pytest

    @pytest.fixture(scope="module")
    def pool():
        with DistributedPool(world_size=world_size) as p:
            yield p

    return pool
