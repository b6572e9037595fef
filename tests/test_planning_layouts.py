"""An impossible layout is refused before any table, with the arithmetic and a layout that fits."""
from __future__ import annotations

import os

import pytest

from megatron_credit.recipe.config import load_recipe
from megatron_credit.planning.plan import GIB, GPUS, plan, resolve_hf_config
from megatron_credit.planning.layouts import layout_refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml")  # TP 8 x PP 2 x CP 2 on 4 x 8 H100


@pytest.fixture(scope="module")
def qwen32b():
    recipe = load_recipe(RECIPE)
    return recipe, resolve_hf_config(recipe.model)


def test_a_layout_that_divides_the_gpus_is_not_refused(qwen32b):
    recipe, hf = qwen32b
    assert layout_refusal(recipe, hf, nodes=4, gpus_per_node=8, gpu="h100-80gb") is None
    assert layout_refusal(recipe, hf, nodes=8, gpus_per_node=8, gpu="h100-80gb") is None  # DP = 2


def test_too_few_gpus_names_the_arithmetic_and_a_layout_of_one_node_that_fits(qwen32b):
    recipe, hf = qwen32b
    msg = layout_refusal(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    fixed = load_recipe(RECIPE, overrides=["parallel.pipeline_model_parallel_size=1", "parallel.context_parallel_size=1"])
    peak = plan(fixed, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb").peak / GIB
    # Two fields changed either way (TP 4 x PP 2 ties with TP 8 alone): the one with the lower peak.
    assert msg == ("parallel: TP x PP x CP = 8 x 2 x 2 = 32 > 8 GPUs (1 node(s) x 8); a layout that fits: "
                   "parallel.tensor_model_parallel_size=8 parallel.pipeline_model_parallel_size=1 "
                   f"parallel.context_parallel_size=1 (DP=1, peak {peak:.1f} of {GPUS['h100-80gb'] / GIB:.1f} GiB)")
    assert plan(fixed, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb").fits


def test_too_few_gpus_names_the_arithmetic_and_the_nodes_on_which_it_fits(qwen32b):
    """Without full recompute no layout of one node holds the activations; four nodes do."""
    recipe, hf = load_recipe(RECIPE, overrides=["train.recompute=selective"]), qwen32b[1]
    msg = layout_refusal(recipe, hf, nodes=1, gpus_per_node=8, gpu="h100-80gb")
    peak = plan(recipe, hf, nodes=4, gpus_per_node=8, gpu="h100-80gb").peak / GIB
    assert msg == ("parallel: TP x PP x CP = 8 x 2 x 2 = 32 > 8 GPUs (1 node(s) x 8); no layout of 8 GPUs fits this "
                   f"recipe in memory; this layout fits on 4 nodes x 8 GPUs (32 GPUs, DP=1, peak {peak:.1f} of "
                   f"{GPUS['h100-80gb'] / GIB:.1f} GiB)")
    for tp, pp, cp in ((8, 1, 1), (4, 2, 1), (2, 2, 2)):  # what the message claims: none of 8 GPUs fits
        overrides = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                     f"parallel.context_parallel_size={cp}", "train.recompute=selective",
                     *(["parallel.sequence_parallel=false"] if tp == 1 else [])]
        assert not plan(load_recipe(RECIPE, overrides=overrides), hf, nodes=1, gpus_per_node=8, gpu="h100-80gb").fits


def test_a_fitting_layout_of_these_gpus_is_the_closest_one_and_really_fits(qwen32b):
    recipe, hf = qwen32b
    msg = layout_refusal(recipe, hf, nodes=2, gpus_per_node=8, gpu="h100-80gb")
    assert msg.startswith("parallel: TP x PP x CP = 8 x 2 x 2 = 32 > 16 GPUs (2 node(s) x 8); a layout that fits: "
                          "parallel.tensor_model_parallel_size=8 parallel.pipeline_model_parallel_size=2 "
                          "parallel.context_parallel_size=1 (DP=1, peak ")
    fixed = load_recipe(RECIPE, overrides=["parallel.context_parallel_size=1"])  # one field changed
    assert plan(fixed, hf, nodes=2, gpus_per_node=8, gpu="h100-80gb").fits
    assert layout_refusal(fixed, hf, nodes=2, gpus_per_node=8, gpu="h100-80gb") is None


def test_a_product_that_does_not_divide_the_gpus_says_so(qwen32b):
    recipe, hf = qwen32b
    msg = layout_refusal(recipe, hf, nodes=3, gpus_per_node=16, gpu="h200")
    assert msg.startswith("parallel: TP x PP x CP = 8 x 2 x 2 = 32 does not divide 48 GPUs (3 node(s) x 16); ")


@pytest.mark.dist
def test_dry_run_refuses_before_any_table_and_never_calls_a_failing_plan_valid():
    import subprocess
    import sys

    def dry(world: int, *extra: str):
        env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", RECIPE, "--dry-run",
                               "--skip-preflight", *extra], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)

    proc = dry(8)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and proc.stdout == "" and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith("error: parallel: TP x PP x CP = 8 x 2 x 2 = 32 > 8 GPUs")
    proc = dry(8, "parallel.pipeline_model_parallel_size=1", "parallel.context_parallel_size=1",
               "train.recompute=selective")
    assert proc.returncode == 1 and "verdict: DOES NOT FIT" in proc.stdout
    assert "the recipe is valid" not in proc.stdout
    assert proc.stdout.rstrip().endswith("dry run: the layout is valid for this world size but its memory plan does "
                                         "not fit (exit 1); nothing was built")


@pytest.mark.dist
def test_dry_run_of_a_layout_error_is_one_refusal_not_a_verdict_then_valid():
    """``--dry-run`` at TP=9 on the SmolLM2 recipe (9 heads, 3 KV heads: the heads fit, vocab_size 49152 does
    not divide by 9): the trainer and the planner both read ``Recipe.problems``, so the dry run refuses it in
    one line before any table, never a planner verdict followed by "the layout is valid"."""
    import subprocess
    import sys

    env = dict(os.environ, WORLD_SIZE="9", RANK="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config",
                           os.path.join(ROOT, "examples", "smollm2_135m_cpu.yaml"), "--dry-run",
                           "parallel.tensor_model_parallel_size=9"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and proc.stdout == "" and "valid" not in proc.stdout, proc.stdout + proc.stderr
    assert errors == ["error: parallel.tensor_model_parallel_size=9 does not divide vocab_size=49152"], proc.stderr


def test_the_trainer_and_the_planner_share_one_list_of_layout_checks():
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.trainer.loop import check_recipe

    recipe = load_recipe(os.path.join(ROOT, "examples", "smollm2_135m_cpu.yaml"),
                         overrides=["parallel.tensor_model_parallel_size=9", "rollout.prompts_per_step=6"])
    hf = resolve_hf_config(recipe.model)
    want = ["parallel.tensor_model_parallel_size=9 does not divide vocab_size=49152",
            "rollout.prompts_per_step=6 must be divisible by the data-parallel size 4"]
    assert recipe.problems(hf, world_size=36) == want
    assert list(plan(recipe, hf, nodes=1, gpus_per_node=36, gpu="h100-80gb").problems) == want
    with pytest.raises(ValueError, match=r"^parallel.tensor_model_parallel_size=9 does not divide vocab_size=49152$"):
        check_recipe(recipe, hf, world_size=36)
    ok = load_recipe(os.path.join(ROOT, "examples", "smollm2_135m_cpu.yaml"),
                     overrides=["parallel.tensor_model_parallel_size=3"])
    assert ok.problems(hf, world_size=3) == [] and ok.validate(world_size=3, arch=hf) == {"tp": 3, "pp": 1, "cp": 1,
                                                                                         "dp": 1}
