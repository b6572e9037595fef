"""Every GPU generates: world size / rollout TP engines, each on devices of its own, the same samples with
1, 2 or 4 engines, the memory order around each generation phase, and the timeout of every group."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.distributed_harness import DistributedPool, _free_port
from tests.support.paths import ROOT
from tests.support.runs import metrics_rows

pytestmark = [pytest.mark.slow, pytest.mark.dist]  # torchrun worlds of 4, a gloo pool

RUN = ["--config", "examples/demo_cpu.yaml", "train.steps=3", "train.val_every=3", "train.val_prompts=16",
       "rollout.prompts_per_step=16", "logging.progress=false", "logging.plots=false", "checkpoint.every=0",
       "checkpoint.save_at_end=false", "data.min_operand=0", "data.max_operand=9", "rollout.max_response_len=4"]
# A short warm-up (one-digit sums) so that rewards vary; cached per layout, so only runs of one trainer
# layout share it
WARM = ["warmup.steps=30", "warmup.batch_size=32", "warmup.lr=3e-3", "warmup.carry_drop_prob=0"]


def _launch(out: str, *args: str, nproc: int, timeout: int = 600):
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *args, "--output-dir", out]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return metrics_rows(out)


def test_the_same_samples_come_from_one_two_or_four_engines(tmp_path):
    # trainer TP 2 x DP 2 on 4 ranks: 4 engines (rollout TP 1, one per rank) against 2 (rollout TP 2) from the
    # same warmed-up policy; then 2 engines against 1 engine on one rank from the same random initial weights
    # (the warm-up depends on the trainer's layout, the initial weights do not)
    tp2, rtp2 = "parallel.tensor_model_parallel_size=2", "rollout.engine_options.tensor_parallel_size=2"
    cache = f"warmup.cache_dir={tmp_path / 'warmup-cache'}"
    four = _launch(str(tmp_path / "four"), *RUN, *WARM, cache, tp2, nproc=4)
    two = _launch(str(tmp_path / "two"), *RUN, *WARM, cache, tp2, rtp2, nproc=4)
    two_random = _launch(str(tmp_path / "two-random"), *RUN, "warmup.steps=0", tp2, rtp2, nproc=4)
    one_random = _launch(str(tmp_path / "one-random"), *RUN, "warmup.steps=0", nproc=1)
    assert [r["rollout/engines"] for r in four + two + one_random] == [4.0] * 3 + [2.0] * 3 + [1.0] * 3
    for a_rows, b_rows in ((four, two), (two_random, one_random)):
        for a, b in zip(a_rows, b_rows, strict=True):
            for key in ("reward/mean", "accuracy/mean", "response_length/mean", "response/truncated_frac"):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert a_rows[-1]["val/accuracy"] == b_rows[-1]["val/accuracy"]
    # equal means are not a coincidence of constant values: rewards and lengths vary
    assert len({r["reward/mean"] for r in four}) > 1 and len({r["response_length/mean"] for r in one_random}) > 1
    for r in four + one_random:  # every engine receives the whole model each iteration
        assert r["sync/bytes"] == one_random[0]["sync/bytes"] > 0 and r["sync/seconds"] > 0


def test_engines_own_their_devices_and_the_trainer_frees_memory_before_they_wake(tmp_path):
    # 4 emulated GPUs under torchrun, trainer TP 2 x DP 2, an engine per rank: each engine gets its own
    # device; around every generation phase: offload (gradient buffers released, optimizer states to the
    # host), empty_cache, wake the weights, sync, wake the KV cache, generate, sleep, restore; then train.
    trace = str(tmp_path / "trace")
    args = ["parallel.tensor_model_parallel_size=2", "train.steps=2", "warmup.steps=0", "train.val_every=2",
            "rollout.prompts_per_step=8", "logging.progress=false", "logging.plots=false", "algorithm.name=ppo",
            "checkpoint.every=0", "checkpoint.save_at_end=false", "model.transformer_impl=local"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
           str(_free_port()), "-m", "tests.support.fakegpu_trace", trace, *args, "--output-dir", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.load(open(f"{trace}.{r}.json", encoding="utf-8")) for r in range(4)]
    gpus = [e[0][1] for e in events]
    assert all(e[0][0] == "engine" for e in events) and sorted(map(tuple, gpus)) == [(0,), (1,), (2,), (3,)]
    phase = ["empty_cache", "offload", "wake", "sync", "wake", "generate", "sleep", "restore"]
    for rank, ev in enumerate(events):
        names = [e[0] for e in ev[1:]]
        # 2 iterations (each: a generation phase, then the update's optimizer steps) + validation
        assert names == phase + ["step", "step"] + phase + ["step", "step"] + phase, (rank, names)
        wakes = [e[1] for e in ev if e[0] == "wake"]
        assert wakes == [["weights"], ["kv_cache"]] * 3
        offloads = [e for e in ev if e[0] == "offload"]
        assert all(o[1] > 0 and o[2] and o[3] for o in offloads)  # bytes given up; grads and states released
        assert offloads[0][4] == 0 and offloads[1][4] > 0  # no Adam state before the first step, then all of it
        assert all(e[1] for e in ev if e[0] == "restore")  # every state back exactly before the update
    rows = metrics_rows(str(tmp_path / "run"))
    assert all(r["rollout/engines"] == 4.0 and r["mismatch/logprob_abs_mean"] < 1e-4 for r in rows)


def _timeouts_after_build(run_dir: str):
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import build
    from tests.support.runs import TINY

    recipe = recipe_from_dict(TINY, overrides=["distributed.timeout_s=4321", "warmup.steps=0",
                                               "parallel.tensor_model_parallel_size=2"])
    device = distributed.initialize(recipe.parallel, seed=recipe.seed, timeout_s=recipe.distributed.timeout_s)
    try:
        run = build(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume="none",
                    log=lambda *a: None)
        run.ctx.rollouts.close()
        return distributed.group_timeouts(), dist.get_world_size()
    finally:
        distributed.destroy()


def test_every_group_the_trainer_makes_has_the_recipes_timeout(tmp_path):
    with DistributedPool(world_size=2) as pool:
        results = pool.run(_timeouts_after_build, str(tmp_path / "run"))
    for timeouts, world in results:
        assert world == 2 and len(timeouts) > 10  # the default group and megatron's
        assert set(timeouts.values()) == {4321.0}, timeouts
