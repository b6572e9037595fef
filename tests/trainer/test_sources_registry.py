"""The rollout sources' registry (``sources/``): one class per ``rollout.mode``, which carries the
mode's facts the recipe checks read, and the one draw loop every mode fills its batch with."""
from __future__ import annotations

import pytest

from megatron_credit.recipe.sections import RolloutConfig
from megatron_credit.sources import ROLLOUT_SOURCES
from megatron_credit.sources.base import check_full, draw_until_full
from megatron_credit.sources.overlap import Async, OneStepOff
from megatron_credit.sources.sync import SyncSource


def test_each_mode_is_one_registered_class_with_its_staleness_bound():
    assert ROLLOUT_SOURCES.names() == ["async", "one_step_off", "sync"]
    assert [ROLLOUT_SOURCES.get(m) for m in ("sync", "one_step_off", "async")] == [SyncSource, OneStepOff, Async]
    bounds = {m: RolloutConfig(mode=m, max_staleness=1, ranks=int(m != "sync")).staleness_bound for m in ROLLOUT_SOURCES}
    assert bounds == {"sync": 0, "one_step_off": 1, "async": 1}
    assert RolloutConfig(mode="async", max_staleness=3, ranks=1).staleness_bound == 3
    assert RolloutConfig(mode="sync", max_staleness=3).staleness_bound == 0
    with pytest.raises(ValueError, match="rollout.max_staleness=3: one_step_off trains on samples exactly one version old"):
        RolloutConfig(mode="one_step_off", max_staleness=3, ranks=1)
    for mode in ("one_step_off", "async"):  # a pool mode needs its pool, and sync has none
        with pytest.raises(ValueError, match=f"rollout.mode={mode} generates on a rollout pool: set rollout.ranks >= 1"):
            RolloutConfig(mode=mode)
    with pytest.raises(ValueError, match="rollout.ranks=1: sync generates on the trainer's own ranks"):
        RolloutConfig(mode="sync", ranks=1)
    assert (Async.interruptible, OneStepOff.interruptible) == (True, False)
    with pytest.raises(ValueError, match="rollout.mode 'sync' is already registered"):
        ROLLOUT_SOURCES.add("sync", SyncSource)


def test_the_draw_loop_stops_when_full_or_out_of_draws_and_keeps_the_surplus():
    seen = []

    def draw(d):
        seen.append(d)
        return [(d, p) for p in range(d % 3)]  # draw 0 keeps nothing, 1 keeps one, 2 keeps two

    kept, draws = draw_until_full(draw, count=3, max_draws=8)
    assert (kept, draws, seen) == ([(1, 0), (2, 0), (2, 1)], 3, [0, 1, 2])
    kept, draws = draw_until_full(lambda d: [d, d], count=3, max_draws=8)
    assert (kept, draws) == ([0, 0, 1, 1], 2)  # the last draw's surplus is kept; the caller takes the first 3
    kept, draws = draw_until_full(lambda d: [], count=3, max_draws=4)
    assert (kept, draws) == ([], 4)
    with pytest.raises(ValueError, match=r"fewer than rollout.prompts_per_step = 3 .* algorithm.max_draws=4 draws \(0 kept\)"):
        check_full(0, count=3, max_draws=4)
    check_full(3, count=3, max_draws=4)


def test_dynamic_sampling_that_an_environment_starved_says_so():
    """When the environment failed on every trajectory of the draws, every group scored all-wrong and the
    one line names the environment's reason; a draw with any trajectory it did not fail on, or single-turn
    samples, keep the line about the draws."""
    import torch

    from megatron_credit.rollout.types import Episode, FinishStatus, RolloutSample
    from megatron_credit.sources.base import env_failures

    def sample(env_errors=None, error=""):
        ep = None if env_errors is None else Episode(turn_rewards=(0.0,), env_errors=env_errors)
        return RolloutSample(prompt_ids=[1], response_ids=[2], logprobs=torch.zeros(1), status=FinishStatus.STOPPED,
                             group_id=0, sample_index=0, logprobs_mode="raw", episode=ep, error=error)

    why = "environment step raised TimeoutError: slow"
    failed = [([sample(1, why), sample(1, "other")], None, None), ([sample(2, why)], None, None)]
    assert env_failures(failed) == (3, 3, why)
    with pytest.raises(ValueError, match=r"^dynamic sampling kept no group: the environment failed on every trajectory "
                                         r"of algorithm.max_draws=4 draws \(3, ended by the abort rule and scored as "
                                         r"wrong\): environment step raised TimeoutError: slow; fix the environment$"):
        check_full(0, count=3, max_draws=4, env_failed=env_failures(failed))
    some = failed + [([sample(0)], None, None)]
    assert env_failures(some) == (3, 4, why)
    with pytest.raises(ValueError, match="fewer than rollout.prompts_per_step = 3"):
        check_full(1, count=3, max_draws=4, env_failed=env_failures(some))
    assert env_failures([([sample(), sample()], None, None)]) == (0, 0, "")
    with pytest.raises(ValueError, match="fewer than rollout.prompts_per_step = 3"):
        check_full(0, count=3, max_draws=4, env_failed=(0, 0, ""))
    check_full(3, count=3, max_draws=4, env_failed=env_failures(failed))  # full: no line at all


def test_a_sync_draw_waits_for_the_leaders_on_the_host_before_its_device_exchange():
    """``SyncSource._draw`` on a rank that leads no engine: it samples nothing, waits in ``leaders_done`` (a
    gloo barrier: on the host, not inside an NCCL kernel on a GPU an engine's worker generates on), and only
    then enters the draw's all-gather."""
    from types import SimpleNamespace

    calls = []

    class Prompts:
        def take(self, count):
            calls.append("take")
            return [None] * count

    stub = SimpleNamespace(rollout=SimpleNamespace(n=2, prompts_per_step=3), prompts=Prompts(), engine=None,
                           verifier_workers=None, tokenizer=None, seed=0, reward=None, dynamic_sampling=True,
                           _params=lambda n, seed: SimpleNamespace(n=n), _my_prompts=lambda count: range(0), leaders_done=lambda: calls.append("leaders_done"),
                           _all_gather=lambda obj: calls.append("all_gather") or [{0: True, 1: False, 2: True}])
    assert SyncSource._draw(stub, 1, 0, {}, {}) == [(0, 0), (0, 2)]
    assert calls == ["take", "leaders_done", "all_gather"]


@pytest.mark.dist
def test_the_host_wait_is_a_gloo_barrier_on_every_rank():
    from tests.support.distributed_harness import DistributedPool

    with DistributedPool(world_size=2) as pool:
        assert pool.run(_host_barrier) == [("gloo", True), ("gloo", True)]


def _host_barrier():
    import datetime

    import torch.distributed as dist

    stub = type("S", (), {"leaders_done": SyncSource.leaders_done})()
    stub.host_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    stub.leaders_done()
    return dist.get_backend(stub.host_group), True
