"""Every algorithm of the catalog trains two iterations on the tiny mixture-of-experts actor (4 experts,
top-2), as ``test_loop_e2e`` does on the dense one: CompPO's gate reads the final layer's attention (which
MoE does not change) and its fused critic the final layer's output; PPO's value head sits on the trunk.
The runs share one warm-up (its cache is keyed by the model, layout and data, not the algorithm)."""
from __future__ import annotations

import math

import pytest

from megatron_credit.algorithm.catalog import ALGORITHMS
from tests.support.distributed_harness import module_pool
from tests.trainer.test_moe_expert_parallel import KEYS, train_moe

pytestmark = pytest.mark.dist

pool = module_pool(1)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-algorithms")


@pytest.mark.parametrize("algorithm", ALGORITHMS.names())
def test_every_algorithm_trains_two_iterations_on_moe(pool, root, algorithm):
    rows = pool.run(train_moe, str(root / algorithm), [f"algorithm.name={algorithm}", "train.val_every=0"])[0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in KEYS), r  # (a rank correlation of constant values is NaN)
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert r["mismatch/logprob_abs_mean"] < 1e-4  # the HF engine holds the actor's (stacked) experts
        assert r["moe/load_balance_loss"] > 0 and 0.25 <= r["moe/expert_load_max_frac"] <= 1.0
