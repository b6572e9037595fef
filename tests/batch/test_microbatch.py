"""Token-budget micro-batching: coverage, budgets, determinism, equal counts across DP ranks."""
import random

import pytest

from megatron_credit.batch.microbatch import (
    make_microbatches,
    max_count_across_ranks,
    microbatch_cost,
    microbatch_stats,
    plan_minibatches,
)
from tests.support.threaded_harness import gloo_and_threads_pool


def _cost_ref(lens, mb, mode, mult):
    padded = [((lens[i] + mult - 1) // mult) * mult for i in mb]
    return len(padded) * max(padded) if mode == "padded" else sum(padded)


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("mult", [1, 4])
def test_random_splits_respect_budget_and_cover_once(mode, mult):
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 40)
        lens = [rng.randint(1, 300) for _ in range(n)]
        budget = rng.randint(50, 1200)
        mbs = make_microbatches(lens, max_tokens_per_microbatch=budget, mode=mode, pad_to_multiple_of=mult)
        assert sorted(i for mb in mbs for i in mb) == list(range(n))
        assert all(mb == sorted(mb) and mb for mb in mbs)
        for mb in mbs:
            cost = _cost_ref(lens, mb, mode, mult)
            assert cost == microbatch_cost(lens, mb, mode=mode, pad_to_multiple_of=mult)
            # Within budget, unless the micro-batch is one sequence that alone exceeds it.
            assert cost <= budget or len(mb) == 1
        # Deterministic: the same lengths give the same split.
        again = make_microbatches(lens, max_tokens_per_microbatch=budget, mode=mode, pad_to_multiple_of=mult)
        assert mbs == again


def test_greedy_is_tight_for_equal_lengths():
    assert len(make_microbatches([10] * 12, max_tokens_per_microbatch=40)) == 3
    assert len(make_microbatches([10] * 12, max_tokens_per_microbatch=40, mode="packed")) == 3
    # Packing beats padding when lengths differ: 9 + 1 + 1 fits one packed micro-batch of 11.
    assert make_microbatches([9, 1, 1], max_tokens_per_microbatch=11, mode="packed") == [[0, 1, 2]]
    assert len(make_microbatches([9, 1, 1], max_tokens_per_microbatch=11, mode="padded")) == 2


def test_oversized_sequence_gets_its_own_microbatch():
    lens = [50, 3, 4, 200, 5]
    mbs = make_microbatches(lens, max_tokens_per_microbatch=60)
    assert [3] in mbs
    stats = microbatch_stats(lens, mbs, max_tokens_per_microbatch=60)
    assert stats["microbatch/oversized"] == 1.0
    assert stats["microbatch/count"] == len(mbs)
    assert 0 < stats["microbatch/token_efficiency"] <= 1


def test_min_num_microbatches_splits_within_budget():
    rng = random.Random(1)
    for _ in range(100):
        lens = [rng.randint(1, 50) for _ in range(rng.randint(4, 30))]
        base = make_microbatches(lens, max_tokens_per_microbatch=400)
        target = rng.randint(len(base), len(lens))
        mbs = make_microbatches(lens, max_tokens_per_microbatch=400, min_num_microbatches=target)
        assert len(mbs) == target
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lens)))
        assert all(_cost_ref(lens, mb, "padded", 1) <= 400 for mb in mbs)
    with pytest.raises(ValueError, match="cannot be empty"):
        make_microbatches([1, 2], max_tokens_per_microbatch=10, min_num_microbatches=3)


def test_plan_minibatches_is_reused_by_both_passes():
    rng = random.Random(2)
    lens = [rng.randint(1, 64) for _ in range(32)]
    plan = plan_minibatches(lens, num_minibatches=4, max_tokens_per_microbatch=128)
    assert plan == plan_minibatches(lens, num_minibatches=4, max_tokens_per_microbatch=128)
    for m, mini in enumerate(plan):
        assert sorted(i for mb in mini for i in mb) == list(range(8 * m, 8 * m + 8))
        local = make_microbatches(lens[8 * m : 8 * m + 8], max_tokens_per_microbatch=128)
        assert mini == [[8 * m + i for i in mb] for mb in local]
    with pytest.raises(ValueError, match="divide"):
        plan_minibatches(lens, num_minibatches=5, max_tokens_per_microbatch=128)


def test_argument_errors():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        make_microbatches([1], max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match="mode"):
        make_microbatches([1], max_tokens_per_microbatch=4, mode="thd")
    assert make_microbatches([], max_tokens_per_microbatch=4) == []
    assert max_count_across_ranks(3) == 3  # no process group: the local count


# ---- DP ranks with different lengths end up with the same number of micro-batches (gloo) ------------


def _equalised_split(seed):
    import torch.distributed as dist

    rng = random.Random(seed + dist.get_rank())
    lens = [rng.randint(1, 100) for _ in range(24)]
    local = make_microbatches(lens, max_tokens_per_microbatch=200)
    target = max_count_across_ranks(len(local))
    mbs = make_microbatches(lens, max_tokens_per_microbatch=200, min_num_microbatches=target)
    return len(local), len(mbs), all(_cost_ref(lens, mb, "padded", 1) <= 200 for mb in mbs)


pool = gloo_and_threads_pool(2)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


def test_equal_microbatch_count_across_dp_ranks(pool):
    for seed in range(0, 40, 4):
        out = pool.run(_equalised_split, seed)
        local_counts = [o[0] for o in out]
        assert [o[1] for o in out] == [max(local_counts)] * 2
        assert all(o[2] for o in out)


def test_tensor_seq_lens_are_accepted():
    import torch

    lens = [5, 3, 8, 1, 7, 2]
    want = make_microbatches(lens, max_tokens_per_microbatch=10, min_num_microbatches=2)
    assert make_microbatches(torch.tensor(lens), max_tokens_per_microbatch=10, min_num_microbatches=2) == want
    assert make_microbatches(torch.tensor([], dtype=torch.long), max_tokens_per_microbatch=10) == []


def test_boundaries_and_messages_of_the_planner():
    # a zero-length sequence is allowed (non-negative), a budget of 1 token is valid, and each refusal
    # says what is wrong
    assert sorted(i for mb in make_microbatches([0, 3], max_tokens_per_microbatch=3) for i in mb) == [0, 1]
    assert make_microbatches([1, 1], max_tokens_per_microbatch=1) == [[0], [1]]
    with pytest.raises(ValueError, match="seq_lens must be non-negative"):
        make_microbatches([2, -1], max_tokens_per_microbatch=4)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of must be >= 1, got 0"):
        make_microbatches([2], max_tokens_per_microbatch=4, pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="micro-batch cannot be empty; use fewer micro-batches"):
        make_microbatches([5], max_tokens_per_microbatch=10, min_num_microbatches=2)  # one sample, two asked


def test_cost_and_stats_by_hand():
    lens = [3, 5, 1]
    assert microbatch_cost(lens, [0, 1], mode="padded") == 10 and microbatch_cost(lens, [0, 1], mode="packed") == 8
    assert microbatch_cost(lens, [0, 2], mode="padded", pad_to_multiple_of=4) == 8
    assert microbatch_cost(lens, [], mode="padded") == 0 and microbatch_cost(lens, [], mode="packed") == 0
    mbs = [[0, 1], [2]]
    stats = microbatch_stats(lens, mbs, max_tokens_per_microbatch=10)  # padded by default
    assert stats == {"microbatch/count": 2.0, "microbatch/token_efficiency": 9 / 11, "microbatch/max_cost": 10.0,
                     "microbatch/oversized": 0.0}  # a cost equal to the budget is not oversized
    padded4 = microbatch_stats(lens, mbs, max_tokens_per_microbatch=9, pad_to_multiple_of=4)
    assert padded4["microbatch/max_cost"] == 16.0 and padded4["microbatch/oversized"] == 1.0
    assert padded4["microbatch/token_efficiency"] == 9 / 20
    packed = microbatch_stats(lens, mbs, max_tokens_per_microbatch=10, mode="packed")
    assert packed["microbatch/token_efficiency"] == 1.0 and packed["microbatch/max_cost"] == 8.0
    one = microbatch_stats([1], [[0]], max_tokens_per_microbatch=1)
    assert one["microbatch/token_efficiency"] == 1.0 and one["microbatch/oversized"] == 0.0
    empty = microbatch_stats([], [], max_tokens_per_microbatch=4)
    assert empty == {"microbatch/count": 0.0, "microbatch/token_efficiency": 0.0, "microbatch/max_cost": 0.0,
                     "microbatch/oversized": 0.0}


def test_plan_passes_every_option_to_each_minibatch():
    lens = [3, 3, 3, 3, 7, 1, 2, 2]  # padding to 4 splits the first half, packing merges the second
    for kw in ({"mode": "packed"}, {"pad_to_multiple_of": 4}, {"min_num_microbatches": 2}, {}):
        plan = plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12, **kw)
        want = [[[s + i for i in mb] for mb in make_microbatches(lens[s:s + 4], max_tokens_per_microbatch=12, **kw)]
                for s in (0, 4)]
        assert plan == want, kw
    assert plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12, pad_to_multiple_of=4) != \
        plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12)  # the options matter here
    assert plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12, min_num_microbatches=2) != \
        plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12)
    assert plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12, mode="packed") != \
        plan_minibatches(lens, num_minibatches=2, max_tokens_per_microbatch=12)
    one = plan_minibatches(lens, num_minibatches=1, max_tokens_per_microbatch=12)  # one mini-batch is valid
    assert one == [make_microbatches(lens, max_tokens_per_microbatch=12)]
