"""The HF engine's decode loop reads the device once per step, counted on the emulated accelerator
(``tests/support/decode_syncs.py``, ``tests/support/fakegpu.py``).

On a GPU every read (a value copied back, boolean indexing, ``nonzero``) waits for the kernels queued so far,
so each one per step stalls the host once per token. The loop used to read five times a step (four boolean
indexings of the row state and a ``nonzero``; six at a compaction, where the noise read the kept rows
again): its state is now updated with ``torch.where`` and one read of which rows go on decides the stop and
the compaction. transformers' own reads (its SDPA mask check, one per forward) are counted apart.
"""
from __future__ import annotations

import pytest

from tests.support.distributed_harness import DistributedPool

pytestmark = [pytest.mark.slow, pytest.mark.dist]  # one pool worker: the emulated backend is process-wide


def _count_and_compare() -> tuple[dict, dict]:
    from tests.support.decode_syncs import count_decode_reads, cpu_samples

    return count_decode_reads(), cpu_samples()


@pytest.fixture(scope="module")
def measured():
    with DistributedPool(world_size=1) as pool:  # a fresh process
        return pool.run(_count_and_compare)[0]


@pytest.fixture(scope="module")
def counted(measured):
    return measured[0]


def test_one_read_of_the_device_per_decode_step(counted):
    assert counted["hf_decode_step"] == {"max": 1, "mean": 1.0}, counted["sites"]
    for name, s in counted["scenarios"].items():
        assert s["project_per_step"] == [1] * s["steps"], (name, s["sites"]["project"])
        (site, n), = s["sites"]["project"].items()  # the one read: which live rows go on
        assert site.startswith("megatron_credit/rollout/hf_engine.py:") and site.endswith(" tolist") \
            and n == s["steps"], (name, site)
        # the pre-fill and set-up read nothing; the results are read back once per call: tokens, log-probs,
        # lengths, statuses, finish steps (and a mixture of experts' routing)
        assert s["project_setup"] == 0 and s["project_results"] == 5 + (name == "moe"), (name, s["project_results"])
    # transformers reads once per forward (masking_utils: whether SDPA may skip the mask); the last step runs none
    assert counted["transformers_decode_step"]["max"] == 1


def test_the_scenarios_cover_compaction_greedy_per_call_and_moe(counted):
    s = counted["scenarios"]
    assert s["sampling"]["steps"] == 6 and s["sampling"]["lengths"] == [6] * 9 and s["sampling"]["compactions"] == 0
    assert s["early_stop"]["compactions"] >= 2 and s["early_stop"]["lengths"][0] == 1 \
        and s["early_stop"]["lengths"][-1] == 8, s["early_stop"]["lengths"]
    assert s["per_call"]["compactions"] >= 1 and s["greedy"]["steps"] == 4 and s["moe"]["steps"] == 6


def test_the_emulated_device_samples_what_the_cpu_samples(measured):
    # The emulated device computes on the CPU with CPU generators of the same seeds: the same samples.
    counted, cpu = measured
    for name, want in cpu.items():
        got = counted["scenarios"][name]["samples"]
        assert [(ids, st) for ids, _, st in got] == [(ids, st) for ids, _, st in want], name
        worst = max(abs(x - y) for (_, a, _), (_, b, _) in zip(got, want) for x, y in zip(a, b))
        assert worst <= 1e-6, (name, worst)
