"""Processes a run left behind: every process started under ``RUN_MARK=<mark>`` (set in the trainer's
environment by :func:`marked_env`) inherits it, through ``exec`` and ``fork`` alike, also after its parent
died and it was re-parented; :func:`wait_until_none_left` looks for them in ``/proc``.
"""
from __future__ import annotations

import os
import time
import uuid

RUN_MARK = "MC_TEST_RUN_MARK"


def marked_env(env: dict) -> tuple[dict, str]:
    """``env`` with a fresh mark, and the mark."""
    mark = uuid.uuid4().hex
    return dict(env, **{RUN_MARK: mark}), mark


def left(mark: str) -> list[str]:
    """``pid command`` of each live (not zombie) process carrying ``mark``, this one excepted."""
    needle = f"{RUN_MARK}={mark}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{name} {command[:200]}")
        except OSError:
            continue  # gone meanwhile
    return out


def wait_until_none_left(mark: str, timeout_s: float = 30.0) -> list[str]:
    """The processes still carrying ``mark`` once none is left or ``timeout_s`` passed (the guard of a killed
    trainer needs its grace period, ``lifetime.GRACE_S``, for a child that ignores SIGTERM)."""
    deadline = time.monotonic() + timeout_s
    while (found := left(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
