"""The planner's time of one iteration and one save, and the Slurm warning lead (``planning/timing.py``)."""
from __future__ import annotations

import math
import os

import pytest

from megatron_credit.planning.gpu_kinds import GPUS
from megatron_credit.planning.plan import Architecture, resolve_hf_config, total_param_count
from megatron_credit.planning.timing import GPU_SPEEDS, MARGIN, iteration_estimate
from megatron_credit.recipe.config import load_recipe
from tests.support.paths import ROOT


def _recipe(name, *overrides):
    recipe = load_recipe(os.path.join(ROOT, "examples", f"{name}.yaml"), overrides=list(overrides))
    return recipe, resolve_hf_config(recipe.model)


def test_every_gpu_kind_has_speeds():
    assert set(GPU_SPEEDS) == set(GPUS)


def test_the_save_is_weights_master_and_adam_over_the_nodes_disks_and_the_lead_covers_iteration_and_save():
    recipe, hf = _recipe("grpo_qwen25_7b")  # bf16, no critic, no reference
    params = total_param_count(Architecture.from_hf(hf))
    e = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=2e9)
    assert e.checkpoint_bytes == params * (2 + 4 + 8)
    assert e.save_s == pytest.approx(params * 14 / 2e9)
    assert e.lead_s == math.ceil((e.generation_s + e.training_s + e.save_s) * MARGIN / 60) * 60
    assert f"sbatch --signal=USR1@{e.lead_s}" in e.lines()[1]
    two = iteration_estimate(recipe, hf, nodes=2, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=2e9)
    assert two.save_s == pytest.approx(e.save_s / 2) and two.training_s == pytest.approx(e.training_s / 2)
    assert two.generation_s == pytest.approx(e.generation_s / 2, rel=0.05)  # the weights' reads do not halve


def test_longer_responses_a_separate_critic_and_slower_gpus_take_longer():
    recipe, hf = _recipe("grpo_qwen25_7b")
    base = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    longer = iteration_estimate(*_recipe("grpo_qwen25_7b", f"rollout.max_response_len={2 * recipe.rollout.max_response_len}"),
                                nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert longer.generation_s > 2 * base.generation_s and longer.training_s > 1.9 * base.training_s
    slower = iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="a100-80gb")
    assert slower.training_s == pytest.approx(base.training_s * 989 / 312)
    ppo, ppo_hf = _recipe("ppo_qwen25_7b", "algorithm.params.critic=separate")
    separate = iteration_estimate(ppo, ppo_hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert separate.checkpoint_bytes == 2 * base.checkpoint_bytes


def test_bad_disk_bandwidth_and_gpu_are_refused():
    recipe, hf = _recipe("grpo_qwen25_7b")
    with pytest.raises(ValueError, match="disk bandwidth"):
        iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb", disk_bytes_per_s=0)
    with pytest.raises(ValueError, match="--gpu"):
        iteration_estimate(recipe, hf, nodes=1, gpus_per_node=8, gpu="v100")
