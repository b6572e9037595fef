"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no bias) and, in
every layer, a routed mixture of SwiGLU experts without shared experts.

Routing, HF (``Qwen3MoeTopKRouter``): ``p = softmax(x W_gate^T)`` over all experts (fp32), the top-k of
``p``, renormalised to sum 1 when ``norm_topk_prob``. megatron's ``topk_softmax_with_capacity`` gives the
same weights: with ``moe_router_pre_softmax=False`` it takes the top-k logits and a softmax over them,
which is ``p_topk / sum(p_topk)`` (the renormalised case); with ``moe_router_pre_softmax=True`` it takes
the softmax over all experts, then the top-k, not renormalised (``norm_topk_prob=False``). Top-k of the
logits and of their softmax pick the same experts (softmax is monotonic). The router runs in fp32
(``moe_router_dtype``), as HF's softmax does.

Weights: the router ``mlp.gate`` (a Linear without bias, [E, hidden]) is megatron's ``mlp.router.weight``
(replicated over TP); expert ``e``'s ``gate_proj`` / ``up_proj`` / ``down_proj`` are the ``linear_fc1``
([gate; up]) / ``linear_fc2`` of ``mlp.experts.local_experts.{e}`` in megatron's ``SequentialMLP`` (the
local spec, CPU) and ``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}`` in its
``TEGroupedMLP`` (TE's grouped GEMM, the GPU default): the same tensors, each expert a rule of its own,
so a converter streams one expert's tensors at a time. The dist checkpoint names both alike
(``TEGroupedMLP.sharded_state_dict`` keys its experts as ``SequentialMLP``'s). The HF names are the
checkpoint's (per expert); transformers 5 holds them stacked in memory (``mlp.experts.gate_up_proj``
[E, 2I, H]) and writes them back per expert.

Refused in one line: ``decoder_sparse_step`` other than 1 and a non-empty ``mlp_only_layers`` (dense
layers between the MoE ones: megatron's ``moe_layer_freq`` could express them; no checkpoint uses it),
and ``num_experts`` of 0.
"""
from __future__ import annotations

from typing import Any, Optional

from megatron_credit.families.base import Family, Kind, Rule, TPSplit, register_family
from megatron_credit.families.dense_rules import (EMBEDDING, FINAL_NORM, INPUT_NORM, K_NORM, OUTPUT, PROJ_WEIGHT,
                                                  Q_NORM, QKV_WEIGHT, L, M, attention_bias, proj_bias, qkv_bias)

E = "mlp.experts.{e}."
X = "mlp.experts.local_experts.{e}."  # SequentialMLP: one module per expert
G = "mlp.experts."  # TEGroupedMLP: one grouped linear per layer, a weight per expert

# Under the TE spec the MoE layer keeps its own pre-MLP norm (no fused linear_fc1 to hold it).
PRE_MLP_NORM = Rule(megatron=M + "pre_mlp_layernorm.weight", hf=(L + "post_attention_layernorm.weight",),
                    kind=Kind.COPY, tp=TPSplit.REPLICATED)
ROUTER = Rule(megatron=M + "mlp.router.weight", hf=(L + "mlp.gate.weight",), kind=Kind.COPY,
              tp=TPSplit.REPLICATED)
EXPERT_FC1 = Rule(megatron=M + X + "linear_fc1.weight", hf=(L + E + "gate_proj.weight", L + E + "up_proj.weight"),
                  kind=Kind.GATE_UP, tp=TPSplit.GATED_ROWS, grouped_megatron=M + G + "linear_fc1.weight{e}")
EXPERT_FC2 = Rule(megatron=M + X + "linear_fc2.weight", hf=(L + E + "down_proj.weight",), kind=Kind.COPY,
                  tp=TPSplit.COLS, grouped_megatron=M + G + "linear_fc2.weight{e}")


class Qwen3Moe(Family):
    def refuse(self, cfg: Any) -> Optional[str]:
        step = getattr(cfg, "decoder_sparse_step", 1)
        if step not in (None, 1):
            return (f"hf_config.decoder_sparse_step={step} is not supported: every layer must be a mixture of "
                    "experts (decoder_sparse_step=1)")
        dense = list(getattr(cfg, "mlp_only_layers", None) or [])
        if dense:
            return (f"hf_config.mlp_only_layers={dense} is not supported: every layer must be a mixture of "
                    "experts (mlp_only_layers=[])")
        if int(getattr(cfg, "num_experts", 0) or 0) < 1:
            return f"hf_config.num_experts={getattr(cfg, 'num_experts', None)} is not supported: it must be >= 1"
        return None

    def num_experts(self, cfg: Any) -> int:
        return int(cfg.num_experts)

    def expert_ffn_hidden_size(self, cfg: Any) -> int:
        return int(cfg.moe_intermediate_size)

    def transformer_config_kwargs(self, cfg: Any) -> dict[str, Any]:
        return dict(
            super().transformer_config_kwargs(cfg),
            num_moe_experts=self.num_experts(cfg),
            moe_ffn_hidden_size=self.expert_ffn_hidden_size(cfg),
            moe_router_topk=int(cfg.num_experts_per_tok),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(getattr(cfg, "norm_topk_prob", False)),
            moe_router_dtype="fp32",
            # The load-balancing loss is a training choice (the recipe's), not a fact of the checkpoint.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )


QWEN3_MOE = register_family(Qwen3Moe(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    qk_layernorm=True,
    tiny_config=dict(head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    rules=(EMBEDDING, INPUT_NORM, QKV_WEIGHT, qkv_bias(when=attention_bias), Q_NORM, K_NORM, PROJ_WEIGHT,
           proj_bias(when=attention_bias), PRE_MLP_NORM, ROUTER, EXPERT_FC1, EXPERT_FC2, FINAL_NORM, OUTPUT),
))
