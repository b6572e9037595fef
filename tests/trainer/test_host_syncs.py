"""The trainer's step does not stall on the host: device-to-host reads counted on the emulated accelerator
(``tests/support/host_syncs.py``, ``tests/support/fakegpu.py``).

Every read (``.item()``, the truth value of a device tensor, ``.tolist()``, ``.cpu()``, a data-dependent shape
such as ``nonzero`` or boolean indexing) makes the host wait until the device has drained its queue. In the
micro-batch loops of the update and of the log-prob pass the project's own code makes none; the iteration
reads a fixed handful, whatever the number of micro-batches (the rows copied back once per pass, one
finiteness check per loss and per optimizer step, the metrics once per reduction). Before these counts were
pinned, CompPO's log-prob pass made 41 reads per micro-batch and every algorithm's forward 4.7 (the CPU
attention's boolean index, the capture's query selection, the concentration kernel's chunk bounds), and a
mixture of experts' update 2.3 more (its router monitor copied each router's counts to the host, its aux-loss
scale was read before each schedule). ``grpo:moe`` is GRPO on a tiny mixture of experts.
megatron-core's own reads (its THD RoPE reads ``cu_seqlens``) are counted apart and not pinned here.
"""
from __future__ import annotations

import pytest

from tests.support.distributed_harness import DistributedPool

pytestmark = [pytest.mark.slow, pytest.mark.dist]  # one process on the emulated device

# The project's reads in the whole fixed-batch iteration (behaviour pass, advantages, two mini-batches, their
# metrics): rows copied back (one per target tensor per pass), the loss's finiteness (one per mini-batch),
# the norms' (one per optimizer step), the metrics (one per reduction); PPO whitens its advantages (one).
ITERATION = {"grpo": 9, "dapo": 9, "dr_grpo": 9, "rloo": 9, "gspo": 9, "fipo": 9, "ppo": 11, "comppo": 14,
             "grpo:moe": 9}


@pytest.fixture(scope="module")
def counts():
    from tests.support.host_syncs import count_update_reads

    with DistributedPool(world_size=1) as pool:
        return pool.run(count_update_reads)[0]


def test_every_algorithm_is_counted_over_several_microbatches(counts):
    assert set(counts) == set(ITERATION)
    for name, r in counts.items():
        assert r["microbatches"]["update"] >= 4 and r["microbatches"]["logprob"] >= 4, (name, r["microbatches"])


@pytest.mark.parametrize("name", list(ITERATION))
def test_the_microbatch_loops_make_no_project_read(counts, name):
    r = counts[name]
    assert r["update_microbatch"] == 0, r["project_sites"]["update"]
    assert r["logprob_microbatch"] == 0, r["project_sites"]["logprob"]


@pytest.mark.parametrize("name", list(ITERATION))
def test_the_iteration_reads_a_fixed_handful(counts, name):
    r = counts[name]
    assert r["iteration"] == ITERATION[name], r["project_sites"]["iteration"]


def test_megatron_cores_reads_are_counted_apart_by_call_site(counts):
    core = counts["grpo"]["megatron_core"]
    sites = {**core["sites"]["update"], **core["sites"]["logprob"]}
    assert core["update_microbatch"] > 0 and sites
    assert all(s.startswith("megatron/core/") for s in sites)
