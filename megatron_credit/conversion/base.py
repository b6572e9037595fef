"""The shapes a conversion needs, read once from the HF config, and the parallel sizes they allow.

The families themselves (config facts, weight rules, the registry) live in :mod:`megatron_credit.families`,
one file per family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_credit.families import FAMILIES


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The shapes a conversion needs, read once from the HF config."""

    num_layers: int
    """Decoder layers."""
    hidden_size: int
    """Model width."""
    num_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Rows per head in q/k/v projections."""
    ffn_hidden_size: int
    """Width of gate/up projections."""
    vocab_size: int
    """Unpadded vocabulary (HF rows of embed_tokens / lm_head)."""
    tie_word_embeddings: bool
    """Whether lm_head shares the embedding."""
    num_experts: int = 0
    """Routed experts per layer (0: a dense MLP)."""
    expert_ffn_hidden_size: int = 0
    """Width of one expert's gate / up projections (0: a dense MLP)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelDims":
        heads = cfg.num_attention_heads
        groups = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        model_type = getattr(cfg, "model_type", None)
        family = FAMILIES.get(model_type) if model_type in FAMILIES else None
        experts = dict(num_experts=family.num_experts(cfg), expert_ffn_hidden_size=family.expert_ffn_hidden_size(cfg)
                       ) if family is not None else {}
        return cls(**experts, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=heads,
                   num_query_groups=groups, head_dim=head_dim, ffn_hidden_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))

    def check_parallel(self, *, tp: int, pp: int, ep: int = 1) -> None:
        """Refuse a TP that splits a head group, a PP that splits the layers unevenly, or an expert-parallel
        size ``ep`` that does not divide the routed experts (the experts' TP is ``tp``)."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        if ep < 1:
            raise ValueError(f"ep must be >= 1, got ep={ep}")
        if ep > 1 and not self.num_experts:
            raise ValueError(f"ep={ep} needs routed experts: the model has none")
        if self.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={self.num_experts}")
        if self.expert_ffn_hidden_size % tp:
            raise ValueError(f"tp={tp} does not divide the experts' intermediate size "
                             f"(moe_intermediate_size={self.expert_ffn_hidden_size})")
        if self.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_attention_heads={self.num_heads}")
        if self.num_query_groups % tp and tp % self.num_query_groups:
            raise ValueError(f"tp={tp} must divide the query groups (num_key_value_heads={self.num_query_groups}) "
                             "or be a multiple of them")
        if (self.num_heads + 2 * self.num_query_groups) * self.head_dim % tp:
            raise ValueError(f"tp={tp} does not divide the rows of linear_qkv ((heads + 2 * groups) * head_dim = "
                             f"{(self.num_heads + 2 * self.num_query_groups) * self.head_dim})")
        if self.vocab_size % tp:
            raise ValueError(f"tp={tp} does not divide vocab_size={self.vocab_size} (the models are built "
                             "without vocabulary padding)")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"tp={tp} does not divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp:
            raise ValueError(f"pp={pp} does not divide num_hidden_layers={self.num_layers}")
