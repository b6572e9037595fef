"""The weight rules shared by the Llama-shaped families (a family file picks from these and adds its own).

HF names under ``model.layers.{i}.`` (``L``) map to megatron names under ``decoder.layers.{i}.`` (``M``).
"""
from __future__ import annotations

from typing import Any, Callable

from megatron_credit.families.base import Kind, Rule, TPSplit, _always

L = "model.layers.{i}."
M = "decoder.layers.{i}."

EMBEDDING = Rule(megatron="embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",),
                 kind=Kind.VOCAB, tp=TPSplit.ROWS)
INPUT_NORM = Rule(megatron=M + "input_layernorm.weight", hf=(L + "input_layernorm.weight",),
                  kind=Kind.COPY, tp=TPSplit.REPLICATED,
                  te_megatron=M + "self_attention.linear_qkv.layer_norm_weight")
QKV_WEIGHT = Rule(megatron=M + "self_attention.linear_qkv.weight",
                  hf=tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), kind=Kind.QKV, tp=TPSplit.ROWS)
PROJ_WEIGHT = Rule(megatron=M + "self_attention.linear_proj.weight", hf=(L + "self_attn.o_proj.weight",),
                   kind=Kind.COPY, tp=TPSplit.COLS)
PRE_MLP_NORM = Rule(megatron=M + "pre_mlp_layernorm.weight", hf=(L + "post_attention_layernorm.weight",),
                    kind=Kind.COPY, tp=TPSplit.REPLICATED, te_megatron=M + "mlp.linear_fc1.layer_norm_weight")
FC1_WEIGHT = Rule(megatron=M + "mlp.linear_fc1.weight", hf=(L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
                  kind=Kind.GATE_UP, tp=TPSplit.GATED_ROWS)
FC2_WEIGHT = Rule(megatron=M + "mlp.linear_fc2.weight", hf=(L + "mlp.down_proj.weight",),
                  kind=Kind.COPY, tp=TPSplit.COLS)
FINAL_NORM = Rule(megatron="decoder.final_layernorm.weight", hf=("model.norm.weight",),
                  kind=Kind.COPY, tp=TPSplit.REPLICATED)
OUTPUT = Rule(megatron="output_layer.weight", hf=("lm_head.weight",), kind=Kind.VOCAB, tp=TPSplit.ROWS,
              when=lambda cfg: not getattr(cfg, "tie_word_embeddings", False))
Q_NORM = Rule(megatron=M + "self_attention.q_layernorm.weight", hf=(L + "self_attn.q_norm.weight",),
              kind=Kind.COPY, tp=TPSplit.REPLICATED)
K_NORM = Rule(megatron=M + "self_attention.k_layernorm.weight", hf=(L + "self_attn.k_norm.weight",),
              kind=Kind.COPY, tp=TPSplit.REPLICATED)


def qkv_bias(when: Callable[[Any], bool] = _always) -> Rule:
    return Rule(megatron=M + "self_attention.linear_qkv.bias",
                hf=tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"), kind=Kind.QKV, tp=TPSplit.ROWS,
                when=when)


def proj_bias(when: Callable[[Any], bool] = _always) -> Rule:
    return Rule(megatron=M + "self_attention.linear_proj.bias", hf=(L + "self_attn.o_proj.bias",),
                kind=Kind.COPY, tp=TPSplit.REPLICATED, when=when)


def attention_bias(cfg: Any) -> bool:
    """HF Llama's / Qwen3's ``attention_bias``: biases on q, k, v and o_proj."""
    return bool(getattr(cfg, "attention_bias", False))
