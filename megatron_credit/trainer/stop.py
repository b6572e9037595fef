"""Stopping on a scheduler's signal (``checkpoint.exit_signals``): finish the iteration, save it, exit 0.

A signal reaches the ranks of a job at different moments, or only some of them (``kill -USR1`` of one
rank, a scheduler that signals one node first). So the handler only records which signal came; at the
end of each iteration every rank calls :meth:`ExitSignals.agreed`, one all-reduce (MAX) of the number of
the signal it holds (0 for none), and all stop after the same iteration, which is then saved. A signal
that arrives on any rank while iteration ``k`` runs stops the run after ``k``; one that arrives during
the collective itself stops it after ``k + 1``, on every rank alike.

Once a stop is agreed, further exit signals are ignored until the process ends: a second warning (Slurm
repeats none, but a user's ``scancel --signal`` may, and torchrun forwards SIGTERM to its workers) must
not turn a saved, orderly stop into a kill during the save or the shutdown after it.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class ExitSignals:
    """Handlers for the signal names in ``names`` while the ``with`` block runs (the main thread only)."""

    def __init__(self, names):
        self.signals = [signal.Signals[n] for n in names]
        self.received: signal.Signals | None = None
        """The first exit signal this process received (None: none yet)."""
        self.stopping = False
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, _frame) -> None:
        # Only a record: the iteration in flight goes on, and logging here could re-enter a write.
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> "ExitSignals":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.stopping else previous)
        self._previous.clear()

    def agreed(self, device: torch.device) -> signal.Signals | None:
        """The exit signal any rank holds (the highest-numbered when ranks hold different ones), the same on
        every rank; None when no rank holds one. Every rank calls it at the same point of each iteration."""
        t = torch.tensor([float(self.received or 0)]).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        number = int(float(t))
        if number == 0:
            return None
        self.stopping = True
        return signal.Signals(number)
