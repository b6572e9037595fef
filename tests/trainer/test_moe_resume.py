"""A mixture-of-experts run resumes bit for bit, and its checkpoint reshards across expert-parallel sizes.

Two gloo ranks (DP = 2) at EP = 1 and EP = 2, in one module-scoped pool, in the manner of
``test_resume_layouts``: a run of two iterations at EP = 2 checkpoints after each; its iteration-1
checkpoint resumed at EP = 2 computes iteration 2 exactly as the uninterrupted run did, and resumed at
EP = 1 (and an EP = 1 checkpoint at EP = 2) loads every tensor of the model and the optimizer bit for bit
(the routed experts, split over EP, are megatron's sharded tensors) and trains on.
"""
from __future__ import annotations

import math

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.runs import TINY_CHECKPOINTED, stable
from tests.trainer.test_moe_expert_parallel import TINY_MOE
from tests.support.resume import global_tensors as _global_tensors
from tests.support.resume import train_checkpointed

pytestmark = pytest.mark.dist

pool2 = module_pool(2)
EP2 = ["parallel.expert_model_parallel_size=2"]
BASE = ["algorithm.name=ppo", "checkpoint.every=1"]
ITER1 = "iter_0000001"


def _train(run_dir: str, resume: str, overrides, saved=None):
    """:func:`train_checkpointed` of the tiny MoE model: ``(rows, log lines, the load's comparison, error)``."""
    base = dict(TINY_CHECKPOINTED, model={"architecture": TINY_MOE})
    return train_checkpointed(run_dir, resume, overrides, saved, base=base)


@pytest.fixture(scope="module")
def straight(pool2, tmp_path_factory):
    """Two iterations at EP = 2 (checkpointed after each) and one at EP = 1: run directories and rows."""
    root = tmp_path_factory.mktemp("moe")
    ep2 = pool2.run(_train, str(root / "ep2"), "none", [*BASE, "train.steps=2", *EP2])[0][0]
    ep1 = pool2.run(_train, str(root / "ep1"), "none", [*BASE, "train.steps=1"])[0][0]
    return root, ep2, ep1


def test_resume_at_ep2_is_bit_for_bit(pool2, straight):
    root, rows, _ = straight
    ckpt = root / "ep2" / "checkpoints" / ITER1
    resumed = pool2.run(_train, str(root / "ep2-resumed"), str(ckpt), [*BASE, "train.steps=2", *EP2])[0][0]
    assert [r["step"] for r in resumed] == [2]
    assert stable(resumed) == stable(rows[1:])
    assert "moe/load_balance_loss" in resumed[0] and "moe/expert_load_max_frac" in resumed[0]


@pytest.mark.parametrize("source, target", [("ep2", []), ("ep1", EP2)], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_the_checkpoint_reshards_across_expert_parallel_sizes(pool2, straight, source, target):
    root = straight[0]
    ckpt = root / source / "checkpoints" / ITER1
    saved = _global_tensors(str(ckpt / "model_optim"), str(root / f"{source}.pt"))
    ranks = pool2.run(_train, str(root / f"{source}-resharded"), str(ckpt), [*BASE, "train.steps=2", *target], saved)
    for rank, (_, _, c, _) in enumerate(ranks):
        assert c["tensors"] > 0 and c["optimizer"] > 0 and c["differ"] == [], (rank, c)
    assert any("resharded from" in line for line in ranks[0][1]), ranks[0][1]
    row = ranks[0][0][0]
    assert row["step"] == 2 and all(math.isfinite(v) for v in row.values()) and row["actor/grad_norm"] > 0
