"""Qwen3 (dense): no q/k/v bias, an RMSNorm on each query and key head (``q_norm``/``k_norm``, [head_dim]).

megatron applies ``q_layernorm``/``k_layernorm`` per head after the QKV split, as HF does before RoPE;
the weights are replicated over TP ranks. ``attention_bias`` (q/k/v/o biases) is mapped if a checkpoint sets it.
Architecture facts (``models/family_facts.QWEN3``): ``qk_layernorm``, and two ``[head_dim]`` norms per layer.
The tiny config decouples head_dim from hidden / heads as the real models do (hidden 64, 4 heads of 32).
"""
from megatron_credit.conversion.base import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                             PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT, Family, proj_bias, Kind, L, M, Rule,
                                             qkv_bias, register_family)
from megatron_credit.conversion.transforms import TPLayout
from megatron_credit.models.family_facts import QWEN3 as ARCH


def _attn_bias(cfg) -> bool:
    return bool(getattr(cfg, "attention_bias", False))  # biases q, k, v and o_proj in HF Qwen3


Q_NORM = Rule(megatron=M + "self_attention.q_layernorm.weight", hf=(L + "self_attn.q_norm.weight",),
              kind=Kind.COPY, tp=TPLayout.REPLICATED)
K_NORM = Rule(megatron=M + "self_attention.k_layernorm.weight", hf=(L + "self_attn.k_norm.weight",),
              kind=Kind.COPY, tp=TPLayout.REPLICATED)

QWEN3 = register_family(Family(
    name="qwen3",
    architectures=(ARCH.architecture,),
    arch=ARCH,
    tiny_config=dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(when=_attn_bias), Q_NORM, K_NORM, PROJ_WEIGHT,
           proj_bias(when=_attn_bias), PRE_MLP_NORM, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, OUTPUT),
))
