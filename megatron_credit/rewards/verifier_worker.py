"""A verifier worker process: ``python -m megatron_credit.rewards.verifier_worker FD [MEMORY_LIMIT]``.

Started by ``rewards/verifier_workers.py`` with ``subprocess.Popen`` (never fork, never multiprocessing's
spawn or forkserver, which re-run the trainer's ``__main__`` and so its torch/megatron imports in every worker).
This module imports only what the verifiers need. ``FD`` is an inherited socket, wrapped in a
``multiprocessing.connection.Connection``. ``MEMORY_LIMIT`` (bytes, 0 or absent for none) becomes
the process's ``RLIMIT_AS`` before anything is imported, so an allocation past it is a ``MemoryError``
in the verifier: one failed item.

Protocol (pickled messages): the worker sends ``"ready"`` once warmed up; it then receives
``(seq, [(idx, module, qualname, response, ground_truth), ...])`` or ``None`` (exit), and answers
``(seq, idx, ok, payload)`` per item, in order (``payload`` is the ``RewardRecord`` or an error
message). The verifier is named by module and qualified name and imported here, so an import error is
one failed item, not a dead worker. A chunk's modules are imported before its first item: the parent gives
a chunk that names a module new to the worker ``verifier_workers.IMPORT_GRACE_S`` for the imports, and the
worker says when they are done (:data:`IMPORTED`). A verifier of a ``--plugin`` file is named by the file's
path, which the worker loads as the trainer did (``plugins.py``).
"""
from __future__ import annotations

import importlib
import signal
import sys
from multiprocessing.connection import Connection

from megatron_credit.lifetime import requests

READY = "ready"
IMPORTED = -1
"""The item index of the answer ``(seq, IMPORTED, True, None)`` a worker sends once it has imported the
modules of a chunk that named one new to it: the parent then starts the first item's own deadline."""


def _lookup(module: str, qualname: str):
    """The verifier ``qualname`` of a module, or of a ``--plugin`` file when ``module`` is its ``.py`` path
    (loaded under the name the trainer gave it, so that what it registers matches)."""
    if module.endswith(".py"):
        from megatron_credit.plugins import load_plugin

        obj = load_plugin(module)
    else:
        obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def limit_address_space(nbytes: int) -> None:
    """Cap this process's virtual address space at ``nbytes`` (soft and hard; never raised above the
    current hard limit)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def main(fd: int, memory_limit_bytes: int = 0) -> None:
    """Serve chunks on the connection ``fd`` until told to stop or the parent goes away."""
    if memory_limit_bytes:
        limit_address_space(memory_limit_bytes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle, then close()
    from megatron_credit.rewards import math as _math
    from megatron_credit.rewards.base import RewardRecord

    # The parent's per-item deadline governs here; the in-process SIGALRM timeout (rewards.math._deadline)
    # must not fire too.
    _math.MATH_VERIFY_TIMEOUT_S = None
    conn = Connection(fd)
    # math-verify builds its grammars and regexes on first use (~0.1 s, seconds on a loaded machine);
    # pay that before reporting ready, so that it never counts against the first item's deadline.
    try:
        _math.score_math_verify("\\boxed{\\frac{1}{2}}", "0.5")
    except Exception:  # noqa: BLE001  (a broken math-verify install shows up as per-item errors)
        pass
    conn.send(READY)
    imported: set[str] = set()
    for seq, chunk in requests(conn):
        new = [m for m in dict.fromkeys(item[1] for item in chunk) if m not in imported]
        for module in new:  # imports first, under the parent's grace; then each item has its own deadline
            imported.add(module)
            try:
                _lookup(module, "")
            except Exception:  # noqa: BLE001  (the item that needs it fails with the error below)
                pass
        if new:
            conn.send((seq, IMPORTED, True, None))
        for idx, module, qualname, response, ground_truth in chunk:
            try:
                record = _lookup(module, qualname)(response, ground_truth)
                if not isinstance(record, RewardRecord):
                    raise TypeError(f"reward fn returned {type(record).__name__}, not RewardRecord")
                conn.send((seq, idx, True, record))
            except Exception as exc:  # noqa: BLE001  (any verifier failure is one failed item)
                message = "MemoryError: over the worker's memory limit" if isinstance(exc, MemoryError) \
                    else f"{type(exc).__name__}: {exc}"
                conn.send((seq, idx, False, message))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
