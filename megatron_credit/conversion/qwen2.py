"""Qwen2 / Qwen2.5: Llama-like layers with a bias on q, k and v (not on o_proj or the MLP)."""
from megatron_credit.conversion.base import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                             PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT, Family, qkv_bias,
                                             register_family)

QWEN2 = register_family(Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(), PROJ_WEIGHT, PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT,
           FINAL_NORM, OUTPUT),
))
