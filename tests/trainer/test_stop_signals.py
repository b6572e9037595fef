"""``checkpoint.exit_signals`` (``trainer/stop.py``): the ranks agree on the iteration to stop after when the
signal reaches one rank only; the recipe refuses what is not a catchable signal, in one line naming the field."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from megatron_credit.recipe.config import recipe_from_dict
from megatron_credit.trainer.stop import ExitSignals
from tests.support.distributed_harness import DistributedPool


def _loop_until_agreed(signalled_rank: int, at_iteration: int, sig_name: str):
    """Iterations 1.. on every rank; ``signalled_rank`` signals itself during ``at_iteration``. Returns the
    iteration each rank stopped after, the agreed signal, and this rank's own record."""
    import torch.distributed as dist

    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        with ExitSignals(["SIGTERM", "SIGUSR1"]) as signals:
            for it in range(1, 20):
                if it == at_iteration and dist.get_rank() == signalled_rank:
                    os.kill(os.getpid(), getattr(signal, sig_name))
                stop = signals.agreed(torch.device("cpu"))
                if stop is not None:
                    return it, stop.name, signals.received and signals.received.name
        return None
    finally:  # the pool's worker lives on: its handlers as they were (a stop leaves them ignoring)
        signal.signal(signal.SIGUSR1, before[0])
        signal.signal(signal.SIGTERM, before[1])


@pytest.mark.dist
def test_every_rank_stops_after_the_iteration_in_which_one_rank_got_the_signal():
    with DistributedPool(world_size=2) as pool:
        assert pool.run(_loop_until_agreed, 1, 3, "SIGUSR1") == [(3, "SIGUSR1", None), (3, "SIGUSR1", "SIGUSR1")]
        assert pool.run(_loop_until_agreed, 0, 1, "SIGTERM") == [(1, "SIGTERM", "SIGTERM"), (1, "SIGTERM", None)]


def test_a_second_signal_after_the_stop_is_ignored_and_no_stop_restores_the_handlers():
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        with ExitSignals(["SIGUSR2"]) as signals:
            assert signals.agreed(torch.device("cpu")) is None
        assert signal.getsignal(signal.SIGUSR2) is previous  # no stop: as before
        with ExitSignals(["SIGUSR2"]) as signals:
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)  # the second changes nothing
            assert signals.agreed(torch.device("cpu")) == signal.SIGUSR2
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN  # stopping: later warnings cannot kill the save
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("value", ["SIGTERM", "[SIGKILL]", "[SIGSTOP]", "[SIGNOPE]", "[15]", "[null]", "{a: 1}", "[SIG_IGN]"])
def test_bad_exit_signals_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^checkpoint\.exit_signals"):
        recipe_from_dict({}, overrides=[f"checkpoint.exit_signals={value}"])


def test_exit_signals_default_and_short_names():
    assert recipe_from_dict({}).checkpoint.exit_signals == ("SIGTERM", "SIGUSR1")
    assert recipe_from_dict({}, overrides=["checkpoint.exit_signals=[usr2, SIGTERM]"]).checkpoint.exit_signals == (
        "SIGUSR2", "SIGTERM")
