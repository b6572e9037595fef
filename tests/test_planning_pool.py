"""The plan of a rollout pool (``planning/pool.py``): the engines' GPUs apart from the trainer's, the weight
update at a stated bandwidth, the bytes each iteration moves, and the one-line refusal of engines that do
not fit; through ``tools/plan.py`` on the 32B async recipe."""
from __future__ import annotations

import math
import os

import pytest

from megatron_credit.planning.architecture import Architecture, total_param_count
from megatron_credit.planning.plan import plan, resolve_hf_config
from megatron_credit.planning.pool import plan_pool, trainer_gpus
from megatron_credit.recipe.config import load_recipe
from tests.support.paths import ROOT

ASYNC_32B = os.path.join(ROOT, "examples", "fipo_qwen25_32b_async.yaml")


def _recipe(*overrides):
    return load_recipe(ASYNC_32B, overrides=list(overrides))


def test_the_32b_async_recipe_fits_with_its_pool_on_a_node_of_its_own():
    recipe = _recipe()
    cfg = resolve_hf_config(recipe.model)
    pool = plan_pool(recipe, cfg, nodes=5, gpus_per_node=8, gpu="h100-80gb")
    assert pool.fits and (pool.engines, pool.gpus_per_engine, pool.trainer_world) == (2, 4, 32)
    params = total_param_count(Architecture.from_hf(cfg))
    assert pool.weight_bytes == params * 2 == pool.staging_host_bytes  # bf16, one version per engine
    assert pool.update_s == pytest.approx(params * 2 / 50e9)  # 400 Gb/s; engines 0, 1 from trainer ranks 0, 1 at once
    per_sample = 4 * (2048 + 20480) + 4 * 20480 + 52
    assert pool.sample_bytes == 512 * 16 * per_sample == pool.sample_bytes_per_head  # DP 1: one head
    # the trainer on the first 4 nodes, with no engine on its GPUs
    assert trainer_gpus(recipe, nodes=5, gpus_per_node=8) == (4, 8)
    trainer = plan(recipe, cfg, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    assert trainer.fits and trainer.terms["rollout_engine"] == 0 and trainer.layout["world"] == 32


def test_the_update_time_scales_with_the_engines_each_trainer_rank_serves():
    recipe = _recipe("rollout.ranks=16", "rollout.engine_options.tensor_parallel_size=1")
    cfg = resolve_hf_config(recipe.model)
    pool = plan_pool(recipe, cfg, nodes=3, gpus_per_node=8, gpu="h200", network_gbps=100)
    assert (pool.engines, pool.trainer_world) == (16, 8)
    assert pool.update_s == pytest.approx(pool.weight_bytes * math.ceil(16 / 8) / 12.5e9)  # 2 engines per sender


def test_engines_that_do_not_fit_are_refused_in_one_line(capsys):
    from megatron_credit.commands.plan import main

    # TP 1 at 45% of an H100: the 61 GiB of weights leave no KV cache
    code = main(["--config", ASYNC_32B, "rollout.engine_options.tensor_parallel_size=1",
                 "rollout.engine_options.gpu_memory_utilization=0.45"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: rollout pool: an engine's KV cache holds 0 tokens, less than one 22528-token sequence")


def test_tools_plan_prints_both_plans_and_says_fits(capsys):
    from megatron_credit.commands.plan import main

    assert main(["--config", ASYNC_32B, "--skip-preflight"]) == 0
    out = capsys.readouterr().out
    assert "4 node(s) x 8 h100-80gb (the trainer's)" in out and "verdict: FITS" in out
    assert "rollout pool: the last 8 of the launch's ranks, 2 engine(s) x 4 GPU(s)" in out
    assert "pool verdict: FITS" in out
    assert "weight update       61.03  GiB per version to each engine; 1.3 s for all 2 at 400 Gb/s" in out
