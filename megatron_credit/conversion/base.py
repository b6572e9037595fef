"""The shapes a conversion needs, read once from the HF config, and the parallel sizes they allow.

The families themselves (config facts, weight rules, the registry) live in :mod:`megatron_credit.families`,
one file per family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelDims":
        heads = cfg.num_attention_heads
        groups = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=heads,
                   num_query_groups=groups, head_dim=head_dim, ffn_hidden_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))

    def check_parallel(self, *, tp: int, pp: int) -> None:
        """Refuse a TP that splits a head group or a PP that splits the layers unevenly."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
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
