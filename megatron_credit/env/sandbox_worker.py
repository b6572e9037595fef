"""A sandbox worker process: ``python -m megatron_credit.env.sandbox_worker FD MEMORY_LIMIT TIMEOUT_S``.

Started by ``env/sandbox.py`` with ``subprocess.Popen`` (never a fork of the trainer, never
multiprocessing's spawn, which re-runs the trainer's ``__main__``). It imports the standard library and
the torch-free ``megatron_credit.env`` package only. ``FD`` is an inherited socket, wrapped in a
``multiprocessing.connection.Connection``.

Before it runs anything it locks itself in, in this order:

1. ``RLIMIT_AS`` = ``MEMORY_LIMIT`` bytes: an allocation past it is a ``MemoryError`` in the function;
2. ``RLIMIT_CPU``: a budget of ``ceil(TIMEOUT_S) + 1`` CPU seconds *per call* (the soft limit is moved to
   the CPU time used so far plus the budget before each call, since the worker is persistent and a
   lifetime limit would kill it after a few calls); past it the kernel kills the process (SIGXCPU). With
   ``alarm`` at the same number of wall seconds, this ends a call even when the parent is gone and so
   cannot kill it;
3. no network: ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` moves the process into an empty network
   namespace where the kernel allows it (containers often refuse; the parent is told which), and in any
   case an audit hook (``sys.addaudithook``, installed after the connection is set up, so it never sees
   the worker's own socket) refuses every ``socket.*`` event, process creation (``subprocess.Popen``,
   ``os.system``, ``os.exec``, ``os.posix_spawn``, ``os.fork``, ``os.spawn``), signals to other processes,
   and ``ctypes`` (which could call the C library's ``socket()`` past the hook) with ``PermissionError``.

The hook is a guard against accidents and naive tricks, not a security boundary against hostile native
code; the namespace, where available, is one for the network.

Protocol (pickled messages): the worker sends ``("ready", isolated)`` once locked in (``isolated``: it
has its own network namespace); it then receives ``(ref, arg)`` or ``None`` (exit) and answers
``(ok, text)``: the function's string result, or ``"ExcType: message"`` (``"out of memory"`` for a
``MemoryError``). ``ref`` is ``"module:qualname"``, imported here on first use. The worker exits when the
parent's end of the connection closes (EOF), so it never outlives the parent while idle.
"""
from __future__ import annotations

import importlib
import math
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

from megatron_credit.env.sandbox import READY
from megatron_credit.lifetime import requests

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

REFUSED_EVENTS = frozenset({
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
    "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
})
"""Audit events refused besides every ``socket.*`` event (module docstring)."""


def refuse_outside_access(event: str, args: tuple) -> None:
    """The audit hook: ``PermissionError`` for network, process creation, signals and ``ctypes``."""
    if event.startswith("socket.") or event in REFUSED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")


def limit_address_space(nbytes: int) -> None:
    """Cap this process's virtual address space at ``nbytes`` (never above the current hard limit)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def limit_cpu(budget_s: int) -> None:
    """Let the process use at most ``budget_s`` more CPU seconds (soft ``RLIMIT_CPU``; the hard limit is
    left alone, since a persistent worker must move the soft one before every call)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime) + budget_s
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def unshare_network() -> bool:
    """Move this (single-threaded) process into new user and network namespaces; whether that worked."""
    flags = CLONE_NEWUSER | CLONE_NEWNET
    try:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(flags)
            return True
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(flags) == 0
    except (OSError, AttributeError):
        return False


def lookup(ref: str) -> Callable[[str], Any]:
    """The function named ``"module:qualname"``."""
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def call(fn_cache: dict[str, Callable[[str], Any]], ref: str, arg: str, budget_s: int) -> tuple[bool, str]:
    """Run ``ref(arg)`` under a fresh CPU budget and wall alarm of ``budget_s`` seconds; ``(ok, text)``."""
    limit_cpu(budget_s)
    signal.alarm(budget_s)  # default action: terminate; ends the call if the parent cannot
    try:
        fn = fn_cache.get(ref)
        if fn is None:
            fn = fn_cache[ref] = lookup(ref)
        result = fn(arg)
        if not isinstance(result, str):
            raise TypeError(f"{ref} returned {type(result).__name__}, not str")
        return True, result
    except MemoryError:
        return False, "out of memory"
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: any failure of the function is one answer)
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)


def main(fd: int, memory_limit_bytes: int, timeout_s: float) -> None:
    """Lock in (module docstring), report ready, then serve calls until told to stop or the parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle, then close()
    conn = Connection(fd)
    budget_s = math.ceil(timeout_s) + 1
    limit_address_space(memory_limit_bytes)
    limit_cpu(budget_s)
    isolated = unshare_network()
    sys.addaudithook(refuse_outside_access)
    conn.send((READY, isolated))
    fn_cache: dict[str, Callable[[str], Any]] = {}
    for ref, arg in requests(conn):
        conn.send(call(fn_cache, ref, arg, budget_s))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
