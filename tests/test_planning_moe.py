"""The planner on mixture-of-experts models: its per-rank parameter counts against megatron's own GPTModel
built on the meta device (the tiny Qwen3-MoE and the real Qwen3-30B-A3B / 235B-A22B shapes, PP 1 / 2,
EP 1 / 2 / 4 / 8 / 16, TP and expert TP), its MoE terms worked out by hand, the layout refusals, and the
example recipe's plan through ``tools/plan.py --ep``.

The meta build runs in this process: megatron's MoE layer takes the expert-parallel size from the group
it is given (``moe_layer.py``: ``num_local_experts = num_moe_experts // ep_size``, ``ep_size =
get_pg_size(pg_collection.ep)``) and the transformer block its layers from the pipeline group's size and
rank, so a ``ProcessGroupCollection`` whose EP / PP / TP / expert-TP entries report the wanted sizes
builds exactly the modules one rank of that layout holds; meta tensors allocate nothing, so the 235B
model's stages build in a fraction of a second.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_credit.planning.plan import (GIB, Architecture, format_plan, known_architecture, plan,
                                           stage_expert_param_count, stage_param_counts, total_param_count)
from megatron_credit.planning.architecture import active_param_count
from megatron_credit.recipe.config import recipe_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MOE = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rope_theta=10000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


class _SizedGroup:
    """A stand-in process group of a given size and rank: all megatron's constructors ask of it."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _hf(arch: dict):
    from megatron_credit.recipe.config import ModelConfig

    return ModelConfig(architecture=arch).hf_config()


def _megatron_stage_numel(hf, *, tp: int, pp: int, ep: int, etp: int, stage: int) -> int:
    """Parameters of pipeline stage ``stage`` of megatron's GPTModel (local spec) on one rank of a
    TP x PP x EP x expert-TP layout, built on the meta device."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_credit.models import transformer_config_from_hf
    from megatron_credit.models.gpt import gpt_decoder_block_spec
    from megatron_credit.recipe.config import ParallelConfig

    tc = dataclasses.replace(transformer_config_from_hf(hf, parallel=ParallelConfig()), tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                             expert_tensor_parallel_size=etp, sequence_parallel=tp > 1 and ep > 1,
                             perform_initialization=False)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.tp, groups.pp = _SizedGroup(tp, 0), _SizedGroup(pp, stage)
    groups.ep, groups.expt_tp = _SizedGroup(ep, 0), _SizedGroup(etp, 0)
    with torch.device("meta"):
        model = GPTModel(config=tc, transformer_layer_spec=gpt_decoder_block_spec(tc, use_transformer_engine=False),
                         vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                         pre_process=stage == 0, post_process=stage == pp - 1,
                         share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
                         position_embedding_type="rope", pg_collection=groups)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-process gloo world with megatron's groups (the meta build reads its default groups)."""
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    owns = not dist.is_initialized()
    distributed.initialize(ParallelConfig(), seed=0)
    yield
    distributed.destroy(process_group=owns)


# (model, tp, pp, ep, etp): every count per rank changes with the layout
LAYOUTS = [("tiny", 1, pp, ep, 1) for pp in (1, 2) for ep in (1, 2, 4)] + [
    ("tiny", 2, 1, 2, 1), ("tiny", 2, 2, 2, 2), ("tiny", 1, 1, 2, 2),
    ("Qwen/Qwen3-30B-A3B", 1, 1, 8, 1), ("Qwen/Qwen3-30B-A3B", 2, 2, 8, 1), ("Qwen/Qwen3-30B-A3B", 2, 2, 1, 2),
    ("Qwen/Qwen3-235B-A22B", 4, 2, 16, 1), ("Qwen/Qwen3-235B-A22B", 8, 2, 8, 2),
]


@pytest.mark.parametrize("model,tp,pp,ep,etp", LAYOUTS, ids=[f"{m.split('/')[-1]}-tp{t}pp{p}ep{e}etp{x}"
                                                               for m, t, p, e, x in LAYOUTS])
def test_stage_counts_equal_megatron_meta_build(one_rank_world, model, tp, pp, ep, etp):
    hf = _hf(TINY_MOE if model == "tiny" else dict(known_architecture(model)))
    a = Architecture.from_hf(hf)
    got = [_megatron_stage_numel(hf, tp=tp, pp=pp, ep=ep, etp=etp, stage=s) for s in range(pp)]
    assert got == stage_param_counts(a, tp=tp, pp=pp, ep=ep, etp=etp)


def test_tiny_moe_counts_by_hand():
    """The tiny Qwen3-MoE (h 64, 4 layers, 4 heads of 32, 2 KV heads, 4 experts of I_e 32, top-2, V 128)."""
    a = Architecture.from_hf(_hf(TINY_MOE))
    assert (a.num_experts, a.top_k, a.expert_ffn) == (4, 2, 32)
    # Attention: QKV (128 + 2 x 64) x 64 + proj 128 x 64 + q/k norms 2 x 32 = 24640; two norms 128;
    # router 4 x 64 = 256; an expert 3 x 64 x 32 = 6144.
    layer = 24640 + 128 + 256
    assert stage_param_counts(a) == [4 * (layer + 4 * 6144) + 2 * 128 * 64 + 64]
    assert stage_param_counts(a, pp=2, ep=4) == [2 * (layer + 6144) + 8192, 2 * (layer + 6144) + 8192 + 64]
    assert stage_param_counts(a, ep=2, etp=2)[0] == 4 * (layer + 2 * 3072) + 16384 + 64
    assert stage_expert_param_count(a, pp=2, ep=2, etp=1) == 2 * 2 * 6144
    assert total_param_count(a) == stage_param_counts(a)[0]
    assert active_param_count(a) == total_param_count(a) - 4 * 2 * 6144  # two of four experts idle


def test_published_sizes_of_qwen3_moe():
    """Qwen3 technical report: 30B-A3B 30.5B total / 3.3B active, 235B-A22B 235B / 22B."""
    for name, total, active in (("Qwen/Qwen3-30B-A3B", 30.5, 3.3), ("Qwen/Qwen3-235B-A22B", 235, 22)):
        a = Architecture.from_hf(_hf(dict(known_architecture(name))))
        assert total_param_count(a) / 1e9 == pytest.approx(total, rel=0.01), name
        assert active_param_count(a) / 1e9 == pytest.approx(active, rel=0.03), name


def _tiny_recipe(overrides=(), **parallel):
    return recipe_from_dict({
        "model": {"architecture": TINY_MOE, "params_dtype": "float32"},
        "parallel": {"pipeline_model_parallel_size": 2, **parallel},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
        "optim": {"backend": "megatron", "distributed_optimizer": True},
        "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64, "logprob_chunk_size": 16},
    }, overrides=list(overrides))


def test_tiny_moe_plan_by_hand_ep2_pp2_on_8_gpus():
    """PP 2, EP 2 on 8 GPUs (TP 1): DP 4, expert DP 8 / (1 x 2 x 2) = 2. fp32."""
    recipe = _tiny_recipe()
    p = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb", ep=2)
    assert p.problems == () and p.layout == {"tp": 1, "pp": 2, "cp": 1, "dp": 4, "world": 8, "ep": 2, "etp": 1,
                                             "edp": 2}
    layer = 24640 + 128 + 256
    stage = 2 * (layer + 2 * 6144) + 8192 + 64  # the last stage: output layer and final norm
    experts = 2 * 2 * 6144
    assert p.terms["weights"] == stage * 4 and p.terms["gradients"] == stage * 4
    # Adam m, v (fp32: no master copy): dense states over DP x CP = 4, the experts' over expert DP = 2
    assert p.terms["optimizer"] == (stage - experts) * 8 // 4 + experts * 8 // 2
    assert p.optimizer_bytes_other == stage * 8
    # Activations of 72 tokens x 4 layers: norms 4 x 64, Q and attention out 2 x 128, K and V 2 x 64,
    # experts top-2 x (64 + 3 x 32) = 320 elements of 4 B, router 8 x 4 experts bytes
    per = 4 * (256 + 256 + 128 + 320) + 32
    assert p.terms["activations"] == 72 * 4 * per
    assert "EP=2 ETP=1 EDP=2" in format_plan(p) and "2 of 4 per layer: EP 2, expert TP 1" in p.notes["weights"]


def test_grouped_and_sequential_experts_plan_the_same_memory_and_sequential_calls_take_time():
    """TE's grouped experts (the default) and ``SequentialMLP`` (``moe.grouped_gemm=false``, or the local spec)
    hold the same weights and activations; the sequential one adds one GEMM call per expert to the training:
    PP 2, EP 2 on 8 GPUs is DP 4, so 8 sequences of 72 tokens are 2 micro-batches of 72 per replica; each of a
    stage's 2 layers makes 2 x 2 local experts = 4 calls in the old log-probs' forward and 4 + 8 in the
    update's forward and backward: 2 x 2 x 16 calls of 20 us."""
    from megatron_credit.planning.timing import EXPERT_GEMM_CALL_S, iteration_estimate

    variants = {"grouped": [], "sequential": ["moe.grouped_gemm=false"], "local": ["model.transformer_impl=local"]}
    plans, times = {}, {}
    for name, overrides in variants.items():
        recipe = _tiny_recipe(overrides)
        plans[name] = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb", ep=2)
        times[name] = iteration_estimate(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb",
                                         ep=2)
    assert plans["grouped"].terms == plans["sequential"].terms
    assert plans["grouped"].notes["activations"].endswith("all-to-all dispatch, TEGroupedMLP")
    assert plans["sequential"].notes["activations"].endswith("all-to-all dispatch, SequentialMLP")
    assert plans["local"].notes["activations"].endswith("all-to-all dispatch, SequentialMLP")
    assert EXPERT_GEMM_CALL_S == 20e-6 and times["grouped"].expert_calls_s == 0.0
    for name in ("sequential", "local"):
        assert times[name].expert_calls_s == pytest.approx(2 * 2 * 16 * 20e-6, rel=1e-12), name
        assert times[name].training_s == pytest.approx(times["grouped"].training_s + 2 * 2 * 16 * 20e-6, rel=1e-12)
        assert "of the training: 0 s of one GEMM call per expert (SequentialMLP, 20 us each" in \
            "\n".join(times[name].lines())


@pytest.mark.parametrize("nodes,parallel,ep,etp,want", [
    (1, {}, 3, 1, "parallel.expert_model_parallel_size=3 does not divide the model's 4 routed experts"),
    (1, {}, 4, 2, "parallel.expert_tensor_parallel_size x parallel.expert_model_parallel_size x "
                  "pipeline_model_parallel_size = 2 x 4 x 2 = 16 does not divide the world of 8 GPUs"),
    (1, {"tensor_model_parallel_size": 2}, 2, 1, "parallel.sequence_parallel must be true with "
     "tensor_model_parallel_size=2 and parallel.expert_model_parallel_size=2 (megatron's MoE layer needs it)"),
])
def test_expert_layout_problems_name_the_field(nodes, parallel, ep, etp, want):
    recipe = _tiny_recipe(**parallel)
    p = plan(recipe, recipe.model.hf_config(), nodes=nodes, gpus_per_node=8, gpu="h100-80gb", ep=ep, etp=etp)
    assert want in p.problems and not p.fits


def test_expert_parallel_on_a_dense_model_is_a_problem():
    from tests.test_planning import TINY_ARCH

    recipe = recipe_from_dict({"model": {"architecture": TINY_ARCH}})
    p = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb", ep=2)
    assert p.problems == ("parallel.expert_model_parallel_size=2 needs routed experts: the model has none",)
    assert "ep" not in p.layout


def test_example_recipe_plans_ep8_through_the_command_line(capsys):
    """``examples/fipo_qwen3_30b_a3b.yaml`` at EP 8 (the header's layout: 16 experts a layer per rank) fits its
    4 x 8 H100-80GB; an EP that does not divide the 128 experts is a layout error, exit 1. (At the recipe's
    own EP, 1 until it carries the field, ``test_every_recipe_fits_its_declared_cluster`` plans it.)"""
    from tools.plan import main

    path = os.path.join(ROOT, "examples", "fipo_qwen3_30b_a3b.yaml")
    assert main(["--config", path, "--ep", "8", "--etp", "1", "--skip-preflight"]) == 0
    out = capsys.readouterr().out
    assert "layout TP=2 PP=2 CP=1 DP=8 EP=8 ETP=1 EDP=2 (world 32)" in out and "verdict: FITS" in out
    assert "16 of 128 per layer: EP 8, expert TP 1" in out
    assert main(["--config", path, "--ep", "3", "--skip-preflight"]) == 1
    assert "layout error: parallel.expert_model_parallel_size=3 does not divide the model's 128 routed experts" \
        in capsys.readouterr().out
    a = Architecture.from_hf(_hf(dict(known_architecture("Qwen/Qwen3-30B-A3B"))))
    assert stage_expert_param_count(a, pp=2, ep=8, etp=1) == 24 * 16 * 3 * 2048 * 768
    assert stage_expert_param_count(a, pp=2, ep=8, etp=1) * 2 / GIB == pytest.approx(3.375)
