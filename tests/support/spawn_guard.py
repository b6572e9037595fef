"""Every test that starts a process says so with a marker, and this module keeps that true.

The markers (registered in ``pytest.ini``; ``make test-fast`` leaves both out):

- ``dist``: the test starts a gloo world in other processes: the workers of a ``DistributedPool``, a
  ``torch.distributed.run`` / ``torchrun.sh`` launch, or the trainer's command line (``pretrain_rl.py``,
  ``tests.support.fakegpu_run``), which initialises its own process group;
- ``spawn``: the test starts other processes that are not a gloo world: a Python subprocess (``python -c``
  probes, a tool's command line), a shell script, the verifier worker processes.

``tests/conftest.py`` tells this module which test is running (:func:`running`, around the setup, call and
teardown of each test) and installs :class:`GuardedPopen` as ``subprocess.Popen``; ``DistributedPool.start``
calls :func:`require`. A test that starts a Python, shell or trainer process, or a gloo pool, without the
marker fails with one line naming itself and the marker to add. Processes that libraries start for
themselves (a multiprocessing ``Manager``, ``ldconfig``) are not checked; the verifier workers are
marked by hand (``tests/support/test_markers.py`` checks the files statically).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any

_item: Any = None  # the pytest item whose setup / call / teardown runs now; None outside a test
_Popen = subprocess.Popen

DIST_ARGS = ("pretrain_rl.py", "torch.distributed.run", "torchrun", "fakegpu_run")
"""A command with one of these in an argument runs the trainer or a launcher: a gloo world (``dist``)."""


def running(item: Any) -> None:
    """Set (or, with None, clear) the test whose phases run now."""
    global _item
    _item = item


def require(markers: tuple[str, ...], what: str) -> None:
    """Raise unless the running test (if any) carries one of ``markers``."""
    item = _item
    if item is None or any(item.get_closest_marker(m) is not None for m in markers):
        return
    raise RuntimeError(f"{item.nodeid} starts {what} but is not marked {' or '.join(markers)}: add "
                       f"@pytest.mark.{markers[0]} (or pytestmark = pytest.mark.{markers[0]}) to it")


def _argv(args: Any) -> list[str]:
    if isinstance(args, (str, bytes)):
        return shlex.split(os.fsdecode(args))
    if isinstance(args, os.PathLike):
        return [os.fspath(args)]
    return [os.fsdecode(a) if isinstance(a, bytes) else str(os.fspath(a) if isinstance(a, os.PathLike) else a)
            for a in args]


def markers_for(args: Any) -> tuple[str, ...]:
    """The markers one of which a test that starts ``args`` must carry; () for a command not checked."""
    argv = _argv(args)
    if not argv:
        return ()
    if any(d in a for a in argv for d in DIST_ARGS):
        return ("dist",)
    prog = os.path.basename(argv[0])
    if argv[0] == sys.executable or prog.startswith("python") or prog in ("bash", "sh") or prog.endswith(".sh"):
        return ("dist", "spawn")
    return ()


class GuardedPopen(_Popen):
    """``subprocess.Popen`` that first checks the running test's markers (:func:`markers_for`)."""

    def __init__(self, args, *a, **kw):
        markers = markers_for(args)
        if markers:
            require(markers, f"a process ({' '.join(_argv(args)[:3])[:120]} ...)")
        super().__init__(args, *a, **kw)


def install() -> None:
    """Make ``subprocess.Popen`` (and so ``subprocess.run`` / ``check_output``) the guarded one."""
    subprocess.Popen = GuardedPopen
