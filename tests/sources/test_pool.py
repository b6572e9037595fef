"""A pool rank's exit after an error (``megatron_credit/sources/pool.failed``): once the trainer said stop, an
exchange its ranks cut short by exiting is the run's end (exit 0, nothing reported); before that, the error
is one line in the store and the log (exit 1)."""
from __future__ import annotations

from megatron_credit.sources import pool

CUT = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:55687")


class FakeBridge:
    """The store side of a ``Bridge``: the trainer's stop and the first error."""

    def __init__(self, stopping: bool, store_gone: bool = False):
        self.said_stop, self.store_gone, self.errors = stopping, store_gone, []

    def stopping(self) -> bool:
        if self.store_gone:
            raise RuntimeError("store gone")
        return self.said_stop

    def fail(self, line: str) -> None:
        self.errors.append(line)
        self.said_stop = True  # the trainer read it and stops the run


def test_an_exchange_cut_after_the_trainer_said_stop_is_the_end(capsys):
    bridge = FakeBridge(stopping=True)
    assert pool.failed(bridge, 2, CUT) == 0
    assert bridge.errors == [] and capsys.readouterr().err == ""


def test_an_error_before_the_stop_is_one_line_for_the_trainer(capsys):
    bridge = FakeBridge(stopping=False)
    assert pool.failed(bridge, 2, CUT) == 1
    line = f"RuntimeError: {CUT}"
    assert bridge.errors == [line] and capsys.readouterr().err == f"error: rollout pool rank 2: {line}\n"


def test_with_the_store_gone_the_error_is_still_this_ranks_line(capsys):
    assert pool.failed(FakeBridge(stopping=False, store_gone=True), 3, CUT) == 1
    assert capsys.readouterr().err.startswith("error: rollout pool rank 3: RuntimeError: ")
