"""A run checkpointed under any of five layouts resumes under each of the other four and trains on.

The layouts: one rank (world 1), and at world 2 TP 2, PP 2, CP 2 and DP 2. Each saves one PPO
iteration of the tiny model once (a module fixture); each of the 20 ordered pairs then resumes that
checkpoint under the other layout and runs one more iteration, in the same two gloo pools (one rank,
two ranks) that trained the sources: a pair costs about a second, not a ``torchrun`` launch.

What a pair asserts:

- right after the load, every tensor of this rank's share of the model and of its optimizer (the AdamW
  moments, sharded like their parameters) equals its slice of the checkpoint's global tensor, bit for bit;
- the iteration counter continues (iteration 2, the log says "resharded from"), the next checkpoint is
  written under the new layout with the optimizer step count carried on, and the iteration's metrics are
  finite with a gradient;
- at DP = 1 the prompts and sampling seeds do not depend on TP / PP / CP, so every DP = 1 target of one
  source samples the same answers and computes the same losses.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.resume import global_tensors as _global_tensors
from tests.support.resume import train_checkpointed as _train
from tests.support.runs import TINY_CHECKPOINTED

pytestmark = pytest.mark.dist

pool1 = module_pool(1)
pool2 = module_pool(2)

LAYOUTS = {
    "1": (1, []),
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "cp2": (2, ["parallel.context_parallel_size=2"]),
    "dp2": (2, []),
}
"""name -> (world size, the recipe's overrides)."""
PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]
BASE = ["algorithm.name=ppo", "checkpoint.every=1"]  # PPO: the value loss has a gradient on a random policy
ITER1, ITER2 = "iter_0000001", "iter_0000002"


def _meta(run_dir) -> dict:
    with open(os.path.join(run_dir, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def _pool(world: int, pool1, pool2):
    return pool1 if world == 1 else pool2


@pytest.fixture(scope="module")
def sources(pool1, pool2, tmp_path_factory):
    """Each layout's run of one iteration: name -> (its iteration-1 checkpoint, the global-tensor file)."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, (world, overrides) in LAYOUTS.items():
        rows, _, _, error = _pool(world, pool1, pool2).run(_train, str(root / name), "none",
                                                           [*BASE, "train.steps=1", *overrides])[0]
        assert error is None and [r["step"] for r in rows] == [1], error
        ckpt = root / name / "checkpoints" / ITER1
        out[name] = (ckpt, _global_tensors(str(ckpt / "model_optim"), str(root / f"{name}.pt")))
    return out


@pytest.fixture(scope="module")
def resumed(pool1, pool2, sources, tmp_path_factory):
    """Every pair resumed, once: (source, target) -> (rank 0's rows, every rank's log, comparison and
    error line, the resumed run's directory)."""
    root = tmp_path_factory.mktemp("resumed")
    out = {}
    for source, target in PAIRS:
        world, overrides = LAYOUTS[target]
        ckpt, saved = sources[source]
        run_dir = root / f"{source}-to-{target}"
        ranks = _pool(world, pool1, pool2).run(_train, str(run_dir), str(ckpt),
                                               [*BASE, "train.steps=2", *overrides], saved)
        out[source, target] = (ranks[0][0], [r[1] for r in ranks], [r[2] for r in ranks], [r[3] for r in ranks],
                               run_dir)
    return out


@pytest.mark.parametrize("source, target", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_checkpoint_resumes_under_another_layout_and_trains_on(sources, resumed, source, target):
    rows, logs, compared, errors, run_dir = resumed[source, target]
    assert errors == [None] * len(errors), errors
    for rank, c in enumerate(compared):  # the resharded state is the saved one, bit for bit
        assert c["tensors"] > 0 and c["optimizer"] > 0 and c["differ"] == [], (rank, c)
    assert any("resharded from" in line and ITER1 in line for line in logs[0]), logs[0]
    assert [r["step"] for r in rows] == [2]
    row = rows[0]
    assert all(math.isfinite(v) for v in row.values()), row
    assert row["actor/grad_norm"] > 0 and row["actor/skipped_steps"] == 0 and row["critic/value_loss"] > 0
    assert row["mismatch/logprob_abs_mean"] < 1e-4  # the engines sample with the loaded weights
    before, after = _meta(sources[source][0]), _meta(run_dir / "checkpoints" / ITER2)
    assert after["step"] == 2 and after["layout"] == _meta(sources[target][0])["layout"] != before["layout"]
    assert after["optimizer_steps"] == before["optimizer_steps"] + TINY_CHECKPOINTED["train"]["num_minibatches"]


DP1 = [name for name in LAYOUTS if name != "dp2"]


@pytest.mark.parametrize("source", list(LAYOUTS))
def test_every_dp1_target_of_one_source_computes_the_same_iteration(resumed, source):
    assert all(resumed[source, t][0] is not None for t in DP1 if t != source), "a resume failed: see its test"
    rows = {t: resumed[source, t][0][0] for t in DP1 if t != source}
    first, *others = rows
    for target in others:
        assert rows[target]["reward/mean"] == rows[first]["reward/mean"], (first, target)
        assert rows[target]["response_length/mean"] == rows[first]["response_length/mean"], (first, target)
        for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "actor/entropy"):
            assert rows[target][k] == pytest.approx(rows[first][k], rel=1e-4, abs=1e-6), (first, target, k)
