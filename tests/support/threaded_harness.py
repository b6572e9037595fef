"""Distributed checks with ranks as threads of the test process (torch's threaded process-group backend).

:class:`ThreadedPool` has :class:`tests.support.distributed_harness.DistributedPool`'s interface: ``run(fn, *args)``
calls ``fn`` on every rank and returns the results in rank order. The ranks are threads of this process
with an initialised ``torch.distributed`` world (the ``threaded`` backend of
``torch.testing._internal.distributed.multi_threaded_pg``: in-memory collectives, subgroups from
``dist.new_group``), so no worker process is spawned.

Why both: the gloo pools run the real backend in real processes, and stay the reference tests. But
``make mutation`` cannot see code that runs in spawned workers (mutmut maps tests to functions by tracing
its own process, and ``tests/conftest.py`` deselects the gloo-pool tests under it), so the
context-parallel carries, the TP reductions and the DP sums had no test that could kill their mutants.
The same worker functions run on threads are traced, and kill them.

The collectives are torch's reference implementations (``AllReduce``, ``AllGather``, ... in that
module), not gloo's; autograd's multithreading is off while a pool runs (torch's own requirement).
``torch.testing._internal`` is torch's test utility, not a public API: checked with torch 2.13.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class ThreadedPool:
    """``world_size`` ranks as threads; ``run`` is collective over all of them (see module docstring)."""

    def __init__(self, world_size: int, *, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s

    def __enter__(self) -> "ThreadedPool":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup,
                                                                           _install_threaded_pg,
                                                                           _uninstall_threaded_pg)

        results: list[Any] = [None] * self.world_size
        errors: list[tuple[int, str]] = []
        store = dist.HashStore()

        def worker(rank: int) -> None:
            dist.init_process_group(backend="threaded", rank=rank, world_size=self.world_size, store=store)
            try:
                results[rank] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised below with this rank's traceback
                errors.append((rank, traceback.format_exc()))
                ProcessLocalGroup.exception_handle(e)  # wake the ranks waiting in a collective
            finally:
                dist.destroy_process_group()

        _install_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        try:
            threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.timeout_s)
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            _uninstall_threaded_pg()
            ProcessLocalGroup.reset()
        if errors:
            rank, tb = sorted(errors)[0]
            raise RuntimeError(f"rank {rank} of the threaded pool failed:\n{tb}")
        if stuck:
            raise TimeoutError(f"ranks {stuck} of the threaded pool still running after {self.timeout_s} s")
        return results


def gloo_and_threads_pool(world_size: int):
    """A module-scoped ``pool`` fixture run twice: ``[gloo]`` (a :class:`DistributedPool` of spawned
    workers; its tests carry the ``dist`` marker) and ``[threads]`` (a :class:`ThreadedPool`, unmarked: in
    ``make test-fast``). Under ``make mutation`` only the ``[threads]`` runs are kept (``tests/conftest.py``)."""
    import pytest

    @pytest.fixture(scope="module", params=[pytest.param("gloo", marks=pytest.mark.dist), "threads"])
    def pool(request):
        if request.param == "threads":
            yield ThreadedPool(world_size=world_size)
            return
        from tests.support.distributed_harness import DistributedPool

        with DistributedPool(world_size=world_size) as p:
            yield p

    return pool
