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


def test_the_32b_async_recipe_fits_with_its_pool_on_nodes_of_its_own():
    recipe = _recipe()
    cfg = resolve_hf_config(recipe.model)
    pool = plan_pool(recipe, cfg, nodes=8, gpus_per_node=8, gpu="h100-80gb")
    assert pool.fits and (pool.engines, pool.gpus_per_engine, pool.trainer_world) == (8, 4, 32)
    params = total_param_count(Architecture.from_hf(cfg))
    assert pool.weight_bytes == params * 2  # bf16, one version to each engine
    # pinned host memory per engine: two versions (one received or loaded, one staged) of 67 buckets: the
    # embedding and the output layer (1.45 GiB each) in 2 GiB blocks, each of the 64 decoder layers (0.91 GiB)
    # in a 1 GiB block, the final norm (10 KiB) in 16 KiB
    assert (pool.buckets, pool.largest_bucket_bytes) == (67, 152064 * 5120 * 2)
    assert pool.staging_host_bytes == 2 * (2 * 2 ** 31 + 64 * 2 ** 30 + 2 ** 14)
    assert pool.engines_per_node == 2 and pool.buckets_in_flight == 2  # vLLM: one received, one loaded
    assert pool.update_s == pytest.approx(params * 2 / 50e9)  # 400 Gb/s; engines 0-7 from trainer ranks 0-7 at once
    per_sample = 4 * (2048 + 20480) + 4 * 20480 + 57  # ids, log-probs, header words, timings, reward, verdict
    assert pool.sample_bytes == 512 * (16 * per_sample + 24) == pool.sample_bytes_per_head  # DP 1: one head
    # the trainer on the first 4 nodes, with no engine on its GPUs
    assert trainer_gpus(recipe, nodes=8, gpus_per_node=8) == (4, 8)
    trainer = plan(recipe, cfg, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    assert trainer.fits and trainer.terms["rollout_engine"] == 0 and trainer.layout["world"] == 32


@pytest.mark.parametrize("prompt,response,routed,turns", [(10, 20, (0, 0), 0), (7, 13, (3, 2), 0), (9, 11, (0, 0), 3),
                                                          (5, 17, (2, 8), 2)])
@pytest.mark.parametrize("n", [1, 4])
def test_the_planned_sample_bytes_are_what_the_wire_encodes(prompt, response, routed, turns, n):
    """``wire_bytes`` against ``rollout/wire.encode`` of a group at those lengths: an MoE engine's routing and
    a trajectory's turns included, byte for byte."""
    import torch

    from megatron_credit.planning.pool import wire_bytes
    from megatron_credit.rollout.types import Episode, FinishStatus, RolloutSample
    from megatron_credit.rollout.wire import encode

    def sample():
        kw = {}
        if routed[0]:
            kw["routed_experts"] = torch.zeros(prompt + response, *routed, dtype=torch.int16)
        if turns:
            kw.update(action_mask=torch.ones(response, dtype=torch.bool), turn_ids=torch.zeros(response, dtype=torch.int16),
                      episode=Episode(turn_rewards=(0.5,) * turns))
        return RolloutSample(prompt_ids=[1] * prompt, response_ids=[2] * response, logprobs=torch.zeros(response),
                             status=FinishStatus.STOPPED, group_id=0, sample_index=0, logprobs_mode="raw", **kw)

    group = ([sample() for _ in range(n)], torch.zeros(n), torch.zeros(n, dtype=torch.bool))
    assert encode([(0, group)]).numel() == wire_bytes(prompt, response, n=n, routed=routed, turns=turns)


def test_an_moe_pool_plans_the_routing_it_returns_for_replay():
    recipe = load_recipe(os.path.join(ROOT, "examples", "fipo_qwen3_30b_a3b.yaml"),
                         overrides=["rollout.mode=async", "rollout.ranks=8"])
    cfg = resolve_hf_config(recipe.model)
    a = Architecture.from_hf(cfg)
    replayed = plan_pool(recipe, cfg, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    off = plan_pool(load_recipe(os.path.join(ROOT, "examples", "fipo_qwen3_30b_a3b.yaml"),
                                overrides=["rollout.mode=async", "rollout.ranks=8", "moe.routing_replay=none"]),
                    cfg, nodes=4, gpus_per_node=8, gpu="h100-80gb")
    r = recipe.rollout
    tokens = recipe.data.max_prompt_len + recipe.response_budget
    assert (a.num_layers, a.top_k) == (48, 8)
    assert replayed.sample_bytes - off.sample_bytes == r.prompts_per_step * r.n * 2 * tokens * 48 * 8


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
    assert "rollout pool: the last 32 of the launch's ranks, 8 engine(s) x 4 GPU(s)" in out
    assert "pool verdict: FITS" in out
    assert "weight update       61.03  GiB per version to each engine; 1.3 s for all 8 at 400 Gb/s" in out
    assert ("pinned host        136.00  GiB per engine: 2 versions (one received or loaded, one staged) of 67 "
            "buckets, each rounded up to a power of two (largest 1.45 GiB); 272.0 GiB per node of 2") in out
    assert "warning:" not in out  # sized so that neither side waits more than half (next test)


def test_a_pool_that_leaves_one_side_waiting_gets_a_warning_with_the_split_that_balances_it(capsys):
    """The 32B async recipe as it was: one pool node (8 GPUs) generates for 40,531 s while 32 GPUs train for
    7,805 s, so the trainer waits 81% of each iteration. On its 5 nodes no split helps (the trainer's TP 8 x
    PP 2 x CP 2 needs 32 GPUs); the warning names the fewest nodes on which one does, and that split is
    checked by the same estimate: neither side waits more than 25%. The recipe now has that split."""
    import re

    from megatron_credit.commands.plan import main
    from megatron_credit.planning.report import BALANCED, balanced_split
    from megatron_credit.planning.timing import iteration_estimate

    recipe = _recipe("rollout.ranks=8", "cluster.nodes=5")
    cfg = resolve_hf_config(recipe.model)
    e = iteration_estimate(recipe, cfg, nodes=5, gpus_per_node=8, gpu="h100-80gb")
    trainer_idle, pool_idle = e.idle_fracs()
    assert trainer_idle == pytest.approx(1 - (e.training_s + e.update_s) / e.generation_s) and pool_idle == 0
    assert trainer_idle > 0.8
    n, ranks, balanced = balanced_split(recipe, cfg, nodes=5, gpus_per_node=8, gpu="h100-80gb")
    assert (n, ranks) == (8, 32) and max(balanced.idle_fracs()) <= BALANCED
    shipped = _recipe()
    assert (shipped.cluster.nodes, shipped.rollout.ranks) == (n, ranks)
    # no split of fewer nodes is balanced (each fewer-node launch tried: the trainer keeps its 32 GPUs)
    for fewer in range(5, 8):
        assert balanced_split(recipe, cfg, nodes=fewer, gpus_per_node=8, gpu="h100-80gb", max_nodes=fewer) is None
    assert main(["--config", ASYNC_32B, "--skip-preflight", "--nodes", "5", "rollout.ranks=8"]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert re.fullmatch(r"warning: the trainer waits 81% of each iteration for the pool; on 8 nodes \(\+3\), "
                        r"rollout\.ranks=32 balances it: one iteration [\d,]+ s against 40,531 s, the trainer "
                        r"waiting \d+% and the pool 0%", line), line
    # a balanced split gets no warning
    assert main(["--config", ASYNC_32B, "--skip-preflight"]) == 0
    assert "warning:" not in capsys.readouterr().out


def test_tools_plan_json_is_the_whole_plan_with_the_pool_s_balance(capsys):
    import json

    from megatron_credit.commands.plan import main

    assert main(["--config", ASYNC_32B, "--skip-preflight", "--json", "--nodes", "5", "rollout.ranks=8"]) == 0
    out = json.loads(capsys.readouterr().out)  # stdout is one JSON object, nothing else
    assert out["fits"] and out["trainer"]["fits"] and out["pool"]["fits"] and out["problems"] == []
    assert (out["trainer_nodes"], out["trainer"]["layout"]["world"], out["pool"]["engines"]) == (4, 32, 2)
    balance = out["pool"]["balance"]
    assert balance["trainer_idle_frac"] == pytest.approx(0.807, abs=5e-3) and balance["pool_idle_frac"] == 0
    e = out["estimate"]
    assert e["iteration_s"] == pytest.approx(max(e["generation_s"], e["training_s"] + e["update_s"]))
    t = out["trainer"]
    assert t["train_peak"] == sum(t["terms"][k] for k in ("weights", "gradients", "optimizer", "critic", "reference",
                                                          "nccl_buffers", "reserve", "cuda_contexts", "activations",
                                                          "logprob_chunk"))
    assert any(x.startswith("warning: the trainer waits") for x in out["lines"])
    assert out["preflight"]["ok"][0].startswith("preflight: skipped")
    # a sync recipe has no pool key, and neither side waits
    assert main(["--config", os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml"), "--skip-preflight", "--json"]) == 0
    sync = json.loads(capsys.readouterr().out)
    assert "pool" not in sync and sync["estimate"]["overlapped"] is False
