"""Qwen2 / Qwen2.5: Llama-like layers with a bias on q, k and v (not on o_proj or the MLP).

Config facts: ``qkv_bias`` - megatron's ``add_qkv_bias``, and ``qkv_rows`` more parameters per layer in
the planner.
"""
from megatron_credit.families.base import Family, register_family
from megatron_credit.families.dense_rules import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                                  PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT, qkv_bias)

QWEN2 = register_family(Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    tiny_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(), PROJ_WEIGHT, PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT,
           FINAL_NORM, OUTPUT),
))
