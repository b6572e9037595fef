"""Llama 3 / 3.1 / 3.2: the plain architecture; ``attention_bias`` adds q/k/v/o biases, ``mlp_bias`` MLP biases.

Llama-3 checkpoints set neither, but both flags exist in the HF config and are honoured here. The
Llama-3 RoPE frequency scaling lives in the model config, not in the weights; the tiny config uses it,
with max_position_embeddings above its original_max_position_embeddings. Config facts: the shared
architecture, nothing added.
"""
from megatron_credit.families.base import Family, Kind, Rule, TPSplit, register_family
from megatron_credit.families.dense_rules import (EMBEDDING, FC1_WEIGHT, FC2_WEIGHT, FINAL_NORM, INPUT_NORM, OUTPUT,
                                                  PRE_MLP_NORM, PROJ_WEIGHT, QKV_WEIGHT, L, M, attention_bias,
                                                  proj_bias, qkv_bias)


def _mlp_bias(cfg) -> bool:
    return bool(getattr(cfg, "mlp_bias", False))


FC1_BIAS = Rule(megatron=M + "mlp.linear_fc1.bias", hf=(L + "mlp.gate_proj.bias", L + "mlp.up_proj.bias"),
                kind=Kind.GATE_UP, tp=TPSplit.GATED_ROWS, when=_mlp_bias)
FC2_BIAS = Rule(megatron=M + "mlp.linear_fc2.bias", hf=(L + "mlp.down_proj.bias",),
                kind=Kind.COPY, tp=TPSplit.REPLICATED, when=_mlp_bias)

LLAMA = register_family(Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    tiny_config=dict(max_position_embeddings=16384,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(when=attention_bias), PROJ_WEIGHT,
           proj_bias(when=attention_bias), PRE_MLP_NORM, FC1_WEIGHT, FC1_BIAS, FC2_WEIGHT, FC2_BIAS, FINAL_NORM,
           OUTPUT),
))
