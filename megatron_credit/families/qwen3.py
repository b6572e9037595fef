"""Qwen3 (dense): no q/k/v bias, an RMSNorm on each query and key head (``q_norm``/``k_norm``, [head_dim]).

megatron applies ``q_layernorm``/``k_layernorm`` per head after the QKV split, as HF does before RoPE;
the weights are replicated over TP ranks. ``attention_bias`` (q/k/v/o biases) is mapped if a checkpoint
sets it. Config facts: ``qk_layernorm`` (megatron's spec and config flag), and two ``[head_dim]`` norms per
layer in the planner. The tiny config decouples head_dim from hidden / heads as the real models do
(hidden 64, 4 heads of 32).
"""
from megatron_credit.families.base import Family, register_family
from megatron_credit.families.dense_rules import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, K_NORM,
                                                  OUTPUT, PRE_MLP_NORM, PROJ_WEIGHT, Q_NORM, QKV_WEIGHT,
                                                  attention_bias, proj_bias, qkv_bias)

QWEN3 = register_family(Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    qk_layernorm=True,
    tiny_config=dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(when=attention_bias), Q_NORM, K_NORM, PROJ_WEIGHT,
           proj_bias(when=attention_bias), PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, OUTPUT),
))
