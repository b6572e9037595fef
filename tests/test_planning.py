"""The memory planner: its arithmetic against numbers worked out by hand for two configurations, its
parameter counts against megatron's own built models (TP = 1 in-process; TP = 2 and PP = 2 in gloo
workers) and against the published sizes, and the command line's exit codes."""
from __future__ import annotations

import os

import pytest

from megatron_credit.recipe.config import load_recipe, recipe_from_dict
from megatron_credit.planning.plan import (CUDA_CONTEXT_BYTES, GIB, GPUS, RESERVED_BYTES, Architecture, format_plan,
                                      known_architecture, plan, resolve_hf_config, stage_param_counts,
                                      total_param_count)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARCH = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_tiny_tp2_fp32_hf_engine_by_hand():
    """Configuration A: the tiny Qwen2 (h 64, I 128, L 2, 4 heads, 2 KV heads of 16, V 128, untied) in fp32,
    TP = 2 on 2 GPUs, micro-batch budget 64 tokens, responses of 8, the hf engine at rollout TP 1: one
    engine per GPU, 4 prompts x 2 = 8 rows over 2 engines."""
    recipe = recipe_from_dict({
        "model": {"architecture": TINY_ARCH, "params_dtype": "float32"},
        "parallel": {"tensor_model_parallel_size": 2},
        "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
        "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64, "logprob_chunk_size": 16},
    })
    p = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb")
    assert p.problems == () and p.layout == {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "world": 2}
    # One layer on one TP rank: QKV (64 + 2*32) / 2 = 64 rows x 64 + bias 64, proj 32 x 64,
    # SwiGLU 3 x 64 x 128 / 2, two norms of 64: 4096 + 64 + 2048 + 12288 + 128 = 18624.
    # The one stage: 2 layers + embedding 128 x 64 / 2 + output 4096 + final norm 64 = 45504.
    params = 2 * 18624 + 4096 + 4096 + 64
    assert params == 45504
    assert p.terms["weights"] == params * 4 and p.terms["gradients"] == params * 4
    assert p.terms["optimizer"] == params * 8  # fp32: Adam m and v only, no master copy
    assert p.terms["critic"] == 0 and p.terms["reference"] == 0
    # Activations: a micro-batch of max(64, prompt 64 + response 8) = 72 tokens; per token and layer
    # 4 x 64 (norms, no SP) + 2 x 4 x 16 / 2 (Q, attention out) + 2 x 16 (K, V: one KV head) + 3 x 128 / 2
    # = 544 floats of 4 bytes, x 2 layers x 72 tokens.
    assert p.terms["activations"] == 544 * 4 * 2 * 72 == 313344
    assert p.terms["logprob_chunk"] == 3 * 4 * 16 * 64 == 12288
    # The hf engine: the whole model (2 x 37120 + 2 x 8192 + 64 = 90688 params) in fp32 and the KV cache
    # of 4 rows x 72 tokens at 2 (K, V) x 2 layers x 2 heads x 16 x 4 bytes = 512 bytes a token.
    assert total_param_count(Architecture.from_hf(recipe.model.hf_config())) == 90688
    assert (p.engines, p.gpus_per_engine, p.kv_tokens) == (2, 1, 4 * 72)
    assert p.terms["rollout_engine"] == 90688 * 4 + 4 * 72 * 512 == 510208
    assert p.terms["cuda_contexts"] == CUDA_CONTEXT_BYTES  # the hf engine lives in the trainer's process
    assert p.offload_bytes == params * (4 + 8)  # fp32 gradients + Adam m, v
    # NCCL: the world and the TP group (2 ranks each, 2 peers) and the model-parallel group (TP x PP = 2):
    # 4 MiB x 16 channels x 2 peers = 128 MiB each; DP, CP and PP are single ranks.
    assert p.terms["nccl_buffers"] == 3 * 128 * 2 ** 20
    resident = params * 16 + 3 * 128 * 2 ** 20 + RESERVED_BYTES + CUDA_CONTEXT_BYTES
    assert p.train_peak == resident + 313344 + 12288
    assert p.rollout_peak == resident - params * 12 + 510208
    assert p.fits and p.peak == p.train_peak


def test_ppo_critic_on_the_trunk_or_a_separate_value_model():
    """PPO's value head on the trunk: hidden + 1 parameters with their gradient and Adam states. A separate
    value model (``algorithm.params.critic: separate``): the actor's weights, fp32 gradients and optimizer
    states again, sharded like the actor's (here: bf16 weights, fp32 masters, distributed optimizer over
    DP = 2)."""
    base = {"model": {"architecture": {**TINY_ARCH, "torch_dtype": "bfloat16"}, "params_dtype": "bfloat16"},
            "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
            "algorithm": {"name": "ppo"},
            "optim": {"backend": "megatron", "distributed_optimizer": True},
            "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64}}
    trunk = recipe_from_dict(base)
    separate = recipe_from_dict(base, overrides=["algorithm.params.critic=separate"])
    pt = plan(trunk, trunk.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb", distributed_optimizer=True)
    ps = plan(separate, separate.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb", distributed_optimizer=True)
    assert pt.terms["critic"] == (64 + 1) * (2 + 4 + 12)  # bf16 head, fp32 gradient, m + v + master
    params = pt.terms["weights"] // 2
    assert ps.terms["optimizer"] == params * 12 // 2  # sharded over DP = 2
    assert ps.terms["critic"] == params * 2 + params * 4 + params * 12 // 2
    assert ps.terms["critic"] == ps.terms["weights"] + ps.terms["gradients"] + ps.terms["optimizer"]
    assert ps.train_peak - pt.train_peak == ps.terms["critic"] - pt.terms["critic"]
    assert "separate value model" in ps.notes["critic"]


def test_lora_plans_a_frozen_base_its_fp32_adapters_and_no_reference_copy_by_hand():
    """LoRA (rank 4, the four projections) at TP 2: the bf16 base's weights stay, plus fp32 adapters (per layer
    on a rank: qkv A [4, 64] + B [128 / 2, 4], proj A [4, 64 / 2] + B [64, 4], fc1 A [4, 64] + B [256 / 2, 4],
    fc2 A [4, 128 / 2] + B [64, 4]); gradients 4 B and Adam states 8 B per adapter parameter; the KL
    reference is the adapters off (no copy). The save holds the adapters and their moments."""
    from megatron_credit.planning.timing import checkpoint_size

    base = {"model": {"architecture": {**TINY_ARCH, "torch_dtype": "bfloat16"}, "params_dtype": "bfloat16"},
            "parallel": {"tensor_model_parallel_size": 2},
            "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
            "algorithm": {"name": "grpo", "kl_coef": 0.01},
            "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64}}
    full = recipe_from_dict(base)
    lora = recipe_from_dict(base, overrides=["model.lora.rank=4"])
    pf = plan(full, full.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb")
    pl = plan(lora, lora.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb")
    adapters = 2 * 4 * ((64 + 64) + (32 + 64) + (64 + 128) + (64 + 64))
    assert pl.terms["weights"] == pf.terms["weights"] + adapters * 4
    assert pl.terms["gradients"] == adapters * 4 and pl.terms["optimizer"] == adapters * 8
    assert pf.terms["reference"] == pf.terms["weights"] and pl.terms["reference"] == 0
    assert "the adapters off" in pl.notes["reference"] and "LoRA saves" in pl.notes["gradients"]
    assert pl.train_peak < pf.train_peak
    whole = 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 256) + (128 + 64))  # the adapters at TP 1
    assert checkpoint_size(lora, lora.model.hf_config()) == whole * 12


def test_qwen25_32b_tp8_pp2_cp2_sp_bf16_full_recompute_vllm_by_hand():
    """Configuration B: Qwen2.5-32B (from the known-architecture table) on 4 x 8 H100-80GB, TP 8 with
    sequence parallel, PP 2, CP 2, bf16, full recompute, the distributed optimizer, vLLM at 0.45, KL on."""
    recipe = recipe_from_dict({
        "model": {"name_or_path": "/nonexistent/Qwen2.5-32B", "params_dtype": "bfloat16"},
        "parallel": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2,
                     "context_parallel_size": 2, "sequence_parallel": True},
        "data": {"source": "dataset", "train_path": "x.parquet", "max_prompt_len": 2048},
        "rollout": {"engine": "vllm", "prompts_per_step": 512, "n": 16, "max_response_len": 20480,
                    "engine_options": {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.45}},
        "algorithm": {"name": "grpo", "kl_coef": 1e-3},
        "train": {"num_minibatches": 8, "max_tokens_per_microbatch": 22528, "recompute": "full",
                  "logprob_chunk_size": 1024},
    })
    p = plan(recipe, resolve_hf_config(recipe.model), nodes=4, gpus_per_node=8, gpu="h100-80gb",
             distributed_optimizer=True)
    assert p.problems == () and p.layout == {"tp": 8, "pp": 2, "cp": 2, "dp": 1, "world": 32}
    # A layer on a TP rank: QKV (5120 + 2 x 1024) / 8 = 896 rows x 5120 + bias 896, proj 640 x 5120,
    # SwiGLU 3 x 5120 x 27648 / 8, two norms of 5120.
    layer = 896 * 5120 + 896 + 640 * 5120 + 3 * 5120 * 27648 // 8 + 2 * 5120
    assert layer == 60959616
    # The last stage is the larger: 32 layers + final norm + output 152064 x 5120 / 8.
    params = 32 * layer + 5120 + 152064 * 5120 // 8
    assert params == 2048033792
    assert p.terms["weights"] == 2 * params and p.terms["gradients"] == 4 * params
    assert p.terms["optimizer"] == 12 * params // 2  # fp32 master + m + v over DP x CP = 1 x 2
    assert p.optimizer_bytes_other == 12 * params  # without the distributed optimizer
    assert p.terms["reference"] == 2 * params
    # 22528 tokens / CP 2 = 11264 per GPU. Full recompute keeps 64 layer inputs of 5120 / 8 bf16 values
    # (SP) and one layer's activations: 4 x 5120 / 8 + 2 x 5120 / 8 + 2 x 128 + 3 x 27648 / 8 = 14464 values.
    assert p.terms["activations"] == 11264 * (64 * 2 * 640 + 2 * 14464) == 1248591872
    assert p.terms["logprob_chunk"] == 3 * 4 * 1024 * 152064 // 8
    share = int(0.45 * 81559 * 2 ** 20)
    assert p.terms["rollout_engine"] == share
    total = 64 * (5120 * 7168 + 7168 + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120) + 2 * 152064 * 5120 + 5120
    assert p.kv_tokens == (share - 2 * total // 8) // (2 * 64 * 1 * 128 * 2)
    # Two CUDA contexts a GPU: the trainer rank's and its vLLM worker's.
    assert p.terms["cuda_contexts"] == 2 * CUDA_CONTEXT_BYTES == GIB
    # NCCL: world, TP, CP, DP x CP, TP x PP at 128 MiB; PP of two stages has one peer: 64 MiB (DP = 1: none)
    nccl = 5 * 128 * 2 ** 20 + 64 * 2 ** 20
    assert p.terms["nccl_buffers"] == nccl and "world, tp, pp, cp, dp_cp, tp_pp group(s)" in p.notes["nccl_buffers"]
    resident = 2 * params + 4 * params + 6 * params + 2 * params + nccl + RESERVED_BYTES + GIB
    assert p.offload_bytes == 4 * params + 6 * params  # gradients + the optimizer's DP x CP shard
    assert p.rollout_peak == resident - p.offload_bytes + share
    assert p.train_peak == resident + 1248591872 + 3 * 4 * 1024 * 152064 // 8
    assert p.fits


def test_fipo_32b_recipe_every_gpu_generates_four_engines_of_eight_by_hand():
    """``examples/fipo_qwen25_32b.yaml`` on its 4 x 8 H100-80GB (TP 8 x PP 2 x CP 2, DP 1, bf16, no
    distributed optimizer, vLLM at rollout TP 8 and 0.45): 32 / 8 = 4 engines where one DP replica used to
    generate. While they generate, the optimizer states and fp32 gradients are on the host; each GPU also
    holds two CUDA contexts (the trainer rank's and its vLLM worker's)."""
    recipe = load_recipe(os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml"))
    p = plan(recipe, resolve_hf_config(recipe.model), nodes=4, gpus_per_node=8, gpu="h100-80gb")
    assert p.problems == () and p.layout["dp"] == 1
    assert (p.engines, p.gpus_per_engine) == (4, 8)
    params = 2048033792  # the last stage on one TP rank (configuration B)
    assert p.terms["weights"] == 2 * params and p.terms["gradients"] == 4 * params
    assert p.terms["optimizer"] == 12 * params  # fp32 master + m + v, not sharded
    assert p.terms["cuda_contexts"] == 2 * CUDA_CONTEXT_BYTES == GIB
    assert p.offload_bytes == 16 * params == 32768540672  # 30.52 GiB of pinned host memory a GPU
    assert p.offload_bytes_per_node == 8 * 16 * params
    share = int(0.45 * 81559 * 2 ** 20)
    total = 64 * (5120 * 7168 + 7168 + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120) + 2 * 152064 * 5120 + 5120
    kv = (share - 2 * total // 8) // (2 * 64 * 1 * 128 * 2)  # bf16 K, V of 64 layers, one KV head a GPU
    assert p.terms["rollout_engine"] == share and p.kv_tokens == kv == 924481
    assert p.kv_tokens_per_gpu == 4 * kv // 32 == 115560
    activations, chunk = 1248591872, 3 * 4 * 1024 * 152064 // 8  # configuration B's
    nccl = 5 * 128 * 2 ** 20 + 64 * 2 ** 20  # configuration B's groups: 0.69 GiB where a flat 1.5 GiB was
    assert p.terms["nccl_buffers"] == nccl
    assert p.train_peak == 18 * params + nccl + RESERVED_BYTES + GIB + activations + chunk
    assert p.rollout_peak == 2 * params + nccl + RESERVED_BYTES + GIB + share
    # The plan before the offload: the whole resident set (the trainer's context and NCCL inside a flat
    # 4 GiB reserve, no worker context) plus the engine: 74.17 GiB, now 43.34 GiB.
    assert RESERVED_BYTES + CUDA_CONTEXT_BYTES + 3 * GIB // 2 == 4 * GIB
    before = 18 * params + 4 * GIB + share
    assert p.rollout_peak + p.offload_bytes - CUDA_CONTEXT_BYTES - nccl + 3 * GIB // 2 == before
    assert (round(before / GIB, 2), round(p.rollout_peak / GIB, 2)) == (74.17, 43.34)
    text = format_plan(p)
    assert "rollout 4 engine(s) x 8 GPU(s) (world 32 / rollout.engine_options.tensor_parallel_size 8)" in text
    assert "KV cache          924,481  tokens per engine; 115,560 per GPU (4 engine(s) x 924,481 / 32 GPUs)" in text
    assert "host offload        30.52  pinned host GiB per GPU" in text and "244.14 GiB per node of 8" in text


def test_comppo_4b_recipe_plans_four_engines_of_two_gpus():
    recipe = load_recipe(os.path.join(ROOT, "examples", "comppo_qwen3_4b.yaml"))
    p = plan(recipe, resolve_hf_config(recipe.model), nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert p.problems == () and (p.engines, p.gpus_per_engine) == (4, 2) and p.layout["dp"] == 4
    assert p.terms["cuda_contexts"] == GIB
    assert p.kv_tokens_per_gpu == p.kv_tokens // 2


def _tiny(engine: str, **rollout):
    return recipe_from_dict({
        "model": {"architecture": TINY_ARCH, "params_dtype": "float32"},
        "parallel": {"tensor_model_parallel_size": 2},
        "rollout": {"engine": engine, "prompts_per_step": 8, "n": 2, "max_response_len": 8, **rollout},
        "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64},
    })


def test_hf_engine_one_per_gpu_at_rollout_tp1_one_per_group_above():
    """The hf engine at rollout TP 1 on 8 GPUs (trainer TP 2, DP 4): 8 engines, one per GPU, 8 prompts x 2
    = 16 rows over 8 engines; at rollout TP 2, 4 engines, each on the first GPU of its pair, 4 rows each.
    The engine is the whole fp32 model (90688 params) and the KV of its rows x 72 tokens at 512 B a token."""
    p1 = plan(_tiny("hf"), _tiny("hf").model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert p1.problems == () and p1.layout["dp"] == 4
    assert (p1.engines, p1.gpus_per_engine, p1.kv_tokens) == (8, 1, 2 * 72)
    assert p1.terms["rollout_engine"] == 90688 * 4 + 2 * 72 * 512
    assert p1.terms["cuda_contexts"] == CUDA_CONTEXT_BYTES  # in the trainer's process: no second context
    r2 = _tiny("hf", engine_options={"tensor_parallel_size": 2})
    p2 = plan(r2, r2.model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert (p2.engines, p2.gpus_per_engine, p2.kv_tokens) == (4, 2, 4 * 72)
    assert p2.terms["rollout_engine"] == 90688 * 4 + 4 * 72 * 512
    assert p2.kv_tokens_per_gpu == 4 * 4 * 72 // 8
    assert "on the first of its 2 GPUs" in p2.notes["rollout_engine"]
    # vLLM in the trainer's process (weight_transfer in_process): one context, as the hf engine.
    r3 = _tiny("vllm", engine_options={"weight_transfer": "in_process"})
    p3 = plan(r3, r3.model.hf_config(), nodes=1, gpus_per_node=8, gpu="h100-80gb")
    assert p3.terms["cuda_contexts"] == CUDA_CONTEXT_BYTES and p3.engines == 8


def test_offload_is_the_gradients_and_the_optimizer_shard_by_hand():
    """The tiny Qwen2 (90688 params at TP 1) in bf16 with the distributed optimizer over DP = 2: the rank
    offloads fp32 gradients (4 B/param) and its half of master + m + v (12 B/param / 2). PPO's value head
    stays on the GPU (counted, not offloaded), so the offload is the same with a critic."""
    base = {"model": {"architecture": {**TINY_ARCH, "torch_dtype": "bfloat16"}, "params_dtype": "bfloat16"},
            "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
            "optim": {"backend": "megatron", "distributed_optimizer": True},
            "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64}}
    for name in ("grpo", "ppo"):
        recipe = recipe_from_dict({**base, "algorithm": {"name": name}})
        p = plan(recipe, recipe.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb")
        assert p.offload_bytes == 4 * 90688 + 12 * 90688 // 2 == 906880, name
        assert p.offload_bytes_per_node == 2 * 906880
        # NCCL: the world, DP and DP x CP groups of 2 ranks (TP, PP, CP single): 3 x 128 MiB
        assert p.terms["nccl_buffers"] == 3 * 128 * 2 ** 20, name
        kept = p.terms["weights"] + p.terms["critic"] + p.terms["nccl_buffers"] + RESERVED_BYTES + p.terms["cuda_contexts"]
        assert p.rollout_peak == kept + p.terms["rollout_engine"]
    assert p.terms["critic"] == (64 + 1) * (2 + 4 + 12)


def test_rollout_tp_must_divide_the_node_and_the_world():
    def problems(rtp: int, nodes: int):
        r = recipe_from_dict({"model": {"architecture": TINY_ARCH, "params_dtype": "float32"},
                              "rollout": {"engine": "vllm", "prompts_per_step": 16, "n": 2, "max_response_len": 8,
                                          "engine_options": {"tensor_parallel_size": rtp}},
                              "train": {"num_minibatches": 2, "max_tokens_per_microbatch": 64}})
        return list(plan(r, r.model.hf_config(), nodes=nodes, gpus_per_node=8, gpu="h100-80gb").problems)

    field = "rollout.engine_options.tensor_parallel_size"
    assert problems(3, 1) == [f"{field}=3 must divide the world size 8 (world size / rollout TP engines, each on "
                              "GPUs of its own)",  # the recipe's own check (Recipe.problems), then the planner's
                              f"{field}=3 does not divide gpus_per_node=8 (an engine's GPUs are on one node)"]
    assert problems(16, 2) == [f"{field}=16 does not divide gpus_per_node=8 (an engine's GPUs are on one node)"]
    assert problems(4, 2) == []


def test_published_sizes():
    """Totals against the model cards, to their last digit: Qwen2.5-7B 7.61B (6.53B without embeddings),
    Qwen3-4B 4.0B (3.6B)."""
    for name, total, non_emb, digit in (("Qwen/Qwen2.5-7B", 7.61, 6.53, 0.01), ("Qwen/Qwen3-4B", 4.0, 3.6, 0.1)):
        row = known_architecture(name)
        arch = Architecture.from_hf(resolve_hf_config(recipe_from_dict({"model": {"name_or_path": name}}).model))
        emb = row["vocab_size"] * row["hidden_size"] * (1 if row["tie_word_embeddings"] else 2)
        n = total_param_count(arch)
        assert n / 1e9 == pytest.approx(total, abs=digit), (name, n)
        assert (n - emb - row["hidden_size"]) / 1e9 == pytest.approx(non_emb, abs=digit), (name, n)


def _megatron_numel(arch: dict, tp: int, pp: int):
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ModelConfig, ParallelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    hf = ModelConfig(architecture=arch).hf_config()
    owns = not dist.is_initialized()
    distributed.initialize(parallel, seed=0)
    try:
        model = build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel), use_transformer_engine=False)
        return sum(p.numel() for p in model.parameters())
    finally:
        distributed.destroy(process_group=owns)


QWEN3_TIED = dict(TINY_ARCH, model_type="qwen3", head_dim=24, tie_word_embeddings=True)
MISTRAL = dict(TINY_ARCH, model_type="mistral", head_dim=24, sliding_window=None)


@pytest.mark.parametrize("arch", [TINY_ARCH, QWEN3_TIED, MISTRAL],
                         ids=["qwen2_untied", "qwen3_tied_head_dim", "mistral_head_dim"])
def test_param_count_equals_megatron_tp1(arch):
    from megatron_credit.recipe.config import ModelConfig

    a = Architecture.from_hf(ModelConfig(architecture=arch).hf_config())
    assert _megatron_numel(arch, 1, 1) == stage_param_counts(a)[0] == total_param_count(a)


@pytest.fixture(scope="module")
def pool2():
    from tests.support.distributed_harness import DistributedPool

    with DistributedPool(world_size=2) as p:
        yield p


@pytest.mark.dist
def test_param_count_equals_megatron_per_rank_tp2_and_pp2(pool2):
    from megatron_credit.recipe.config import ModelConfig

    for arch in (TINY_ARCH, QWEN3_TIED):
        a = Architecture.from_hf(ModelConfig(architecture=arch).hf_config())
        assert pool2.run(_megatron_numel, arch, 2, 1) == [stage_param_counts(a, tp=2)[0]] * 2
        # PP = 2: rank 0 holds the embedding, rank 1 the output layer (a copy when tied) and final norm.
        assert pool2.run(_megatron_numel, arch, 1, 2) == stage_param_counts(a, pp=2)


def test_layout_problems_and_cli_exit_codes(capsys):
    from tools.plan import main

    recipe = os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml")
    assert main(["--config", recipe, "--skip-preflight"]) == 0 and "verdict: FITS" in capsys.readouterr().out
    # One node: 8 GPUs cannot hold TP 8 x PP 2 x CP 2: refused before any table, one error line with the
    # arithmetic and what would fit (with the optimizer and gradients on the host while generating, the
    # training peak of TP 8 alone is the limit).
    assert main(["--config", recipe, "--nodes", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: parallel: TP x PP x CP = 8 x 2 x 2 = 32 > 8 GPUs")
    assert ("a layout that fits: parallel.tensor_model_parallel_size=8 parallel.pipeline_model_parallel_size=1 "
            "parallel.context_parallel_size=1 (DP=1") in captured.err
    # One node with a layout that divides it, without full recompute: the memory does not fit, and the
    # verdict names the term.
    code = main(["--config", recipe, "--nodes", "1", "parallel.pipeline_model_parallel_size=1",
                 "parallel.context_parallel_size=1", "train.recompute=selective", "--skip-preflight"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out and "largest term: optimizer" in out, out
    assert main(["--config", recipe, "--gpu", "tpu-v9"]) == 2
    assert "not one of" in capsys.readouterr().err
    recipe_bad = main(["--config", recipe, "parallel.tensor_model_parallel_size=3"])  # 3 x 2 x 2 = 12 on 32 GPUs
    err = capsys.readouterr().err
    assert recipe_bad == 2 and "TP x PP x CP = 3 x 2 x 2 = 12 does not divide 32 GPUs" in err
    # the closest TP to 3 (log2 distance) whose plan fits: 4 (TP 2 does not fit)
    assert "a layout that fits: parallel.tensor_model_parallel_size=4 parallel.pipeline_model_parallel_size=2" in err
    # A layout that divides the GPUs but not the model still gets its table and the layout error.
    recipe_bad = main(["--config", recipe, "--nodes", "8", "parallel.tensor_model_parallel_size=16", "--skip-preflight"])
    assert recipe_bad == 1 and "does not divide num_attention_heads=40" in capsys.readouterr().out


def test_gpu_table_and_unknown_model():
    assert GPUS["h100-80gb"] / GIB == pytest.approx(79.65, abs=0.01)
    with pytest.raises(ValueError, match="known architectures"):
        resolve_hf_config(recipe_from_dict({"model": {"name_or_path": "/models/mystery-70b"}}).model)


def test_a_budget_that_is_not_a_multiple_of_2cp_is_planned_as_the_trainer_pads_it():
    """CP=2 with train.max_tokens_per_microbatch=63: the trainer pads micro-batches to multiples of 4 and
    trains it, so the plan has no problem and counts 64 tokens, as for 64."""
    def recipe_with(budget):
        return recipe_from_dict({
            "model": {"architecture": TINY_ARCH, "params_dtype": "float32"},
            "parallel": {"context_parallel_size": 2},
            "rollout": {"prompts_per_step": 4, "n": 2, "max_response_len": 8},
            "train": {"num_minibatches": 2, "max_tokens_per_microbatch": budget, "logprob_chunk_size": 16},
        })
    odd, even = (plan(r, r.model.hf_config(), nodes=1, gpus_per_node=2, gpu="h100-80gb")
                 for r in (recipe_with(63), recipe_with(64)))
    assert odd.problems == () and odd.layout == {"tp": 1, "pp": 1, "cp": 2, "dp": 1, "world": 2}
    assert odd.terms == even.terms and odd.train_peak == even.train_peak and odd.train_peak > 0
