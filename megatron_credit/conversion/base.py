"""The declarative description of a model family: model dimensions, name rules, and the registry.

A family is one file, ``<family>.py``, registering one :class:`Family`: its HF architecture, its
architecture facts (:class:`~megatron_credit.models.family_facts.ArchFacts`: what the family means for
megatron's ``TransformerConfig`` and for the planner's parameter count; declared in the models layer,
which reads them), the fields of its tiny test config, and its list of :class:`Rule`: one megatron
parameter <- one or more HF tensors, a :class:`Kind` of transform and the parameter's TP layout. Rules
whose megatron name contains ``{i}`` are repeated for every decoder layer (global layer numbering, the
numbering of a TP=PP=1 model and of the distributed checkpoint). Optional parameters (biases, q/k norms,
the untied output layer) carry a ``when`` predicate on the HF config, so one file per family stays a table.

>>> FAMILIES.get("gpt2")
Traceback (most recent call last):
...
ValueError: unknown model family 'gpt2'; valid names: [...]
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_credit.conversion.transforms import TPLayout
from megatron_credit.models.family_facts import REFUSED_MODEL_TYPES, ArchFacts, arch_facts
from megatron_credit.registry import Registry


class Kind(enum.Enum):
    """How the HF tensors of a rule become the megatron tensor."""

    COPY = "copy"        # one HF tensor, same layout
    QKV = "qkv"          # (q, k, v) -> linear_qkv, rows grouped per query group
    GATE_UP = "gate_up"  # (gate, up) -> linear_fc1 = [gate; up]
    VOCAB = "vocab"      # one HF tensor [V, hidden]; megatron may hold padded rows [V_pad, hidden]


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


def _always(cfg: Any) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Name in a local-spec GPTModel state dict; ``{i}`` is the global layer index."""
    hf: tuple[str, ...]
    """HF names (``{i}`` likewise), in the order the transform takes them."""
    kind: Kind
    """Transform between the two layouts."""
    tp: TPLayout
    """How megatron partitions this parameter over TP ranks."""
    te_megatron: str | None = None
    """Name under the Transformer Engine spec when it differs (fused layer norms)."""
    when: Callable[[Any], bool] = field(default=_always)
    """Predicate on the HF config: is this parameter present?"""

    def megatron_name(self, *, fused_norms: bool) -> str:
        return self.te_megatron if fused_norms and self.te_megatron else self.megatron

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: the HF architectures it accepts, its architecture facts, tiny config and rules."""

    name: str
    """Registry key (the HF ``model_type``)."""
    architectures: tuple[str, ...]
    """HF ``config.architectures`` entries handled by this family."""
    rules: tuple[Rule, ...]
    """The name map (see the module docstring)."""
    arch: ArchFacts | None = None
    """The family's ``TransformerConfig`` and parameter-count facts (None: a test-only family)."""
    tiny_config: dict[str, Any] = field(default_factory=dict, hash=False)
    """Fields of :func:`~megatron_credit.conversion.testing.tiny_hf_config` that differ from its defaults."""

    def active_rules(self, cfg: Any) -> list[Rule]:
        return [r for r in self.rules if r.when(cfg)]

    def check_config(self, cfg: Any) -> None:
        """Refuse (``ValueError``, one line naming the field) a setting the megatron model cannot reproduce."""
        refused = self.arch.refuse(cfg) if self.arch is not None else None
        if refused:
            raise ValueError(refused)


FAMILIES: Registry[Family] = Registry("model family")


def register_family(family: Family) -> Family:
    FAMILIES.add(family.name, family)
    return family


def supported_architectures() -> list[str]:
    import megatron_credit.conversion  # noqa: F401 - importing the package registers the families

    return sorted(a for n in FAMILIES for a in FAMILIES.get(n).architectures)


def family_for_config(cfg: Any) -> Family:
    """The family whose architectures include the config's, its settings checked (``Family.check_config``);
    a clear error listing the supported ones, or saying why a known family (Gemma) is refused."""
    import megatron_credit.conversion  # noqa: F401 - importing the package registers the families

    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    if isinstance(model_type, str) and model_type in REFUSED_MODEL_TYPES:
        arch_facts(model_type)  # raises the reason
    if not archs and model_type in FAMILIES:  # an inline config (recipe architecture) names no class
        FAMILIES.get(model_type).check_config(cfg)
        return FAMILIES.get(model_type)
    for name in FAMILIES:
        fam = FAMILIES.get(name)
        if any(a in fam.architectures for a in archs):
            fam.check_config(cfg)
            return fam
    raise ValueError(f"unsupported architecture {archs or None} (model_type="
                     f"{getattr(cfg, 'model_type', None)!r}); supported: {supported_architectures()}")


# --- the rules shared by the Llama-like families --------------------------------------------------
L = "model.layers.{i}."
M = "decoder.layers.{i}."

EMBEDDING = Rule(megatron="embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",),
                 kind=Kind.VOCAB, tp=TPLayout.ROWS)
INPUT_NORM = Rule(megatron=M + "input_layernorm.weight", hf=(L + "input_layernorm.weight",),
                  kind=Kind.COPY, tp=TPLayout.REPLICATED,
                  te_megatron=M + "self_attention.linear_qkv.layer_norm_weight")
QKV_WEIGHT = Rule(megatron=M + "self_attention.linear_qkv.weight",
                  hf=tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), kind=Kind.QKV, tp=TPLayout.ROWS)
PROJ_WEIGHT = Rule(megatron=M + "self_attention.linear_proj.weight", hf=(L + "self_attn.o_proj.weight",),
                   kind=Kind.COPY, tp=TPLayout.COLS)
PRE_MLP_NORM = Rule(megatron=M + "pre_mlp_layernorm.weight", hf=(L + "post_attention_layernorm.weight",),
                    kind=Kind.COPY, tp=TPLayout.REPLICATED, te_megatron=M + "mlp.linear_fc1.layer_norm_weight")
FC1_WEIGHT = Rule(megatron=M + "mlp.linear_fc1.weight", hf=(L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
                  kind=Kind.GATE_UP, tp=TPLayout.GATED_ROWS)
FC2_WEIGHT = Rule(megatron=M + "mlp.linear_fc2.weight", hf=(L + "mlp.down_proj.weight",),
                  kind=Kind.COPY, tp=TPLayout.COLS)
FINAL_NORM = Rule(megatron="decoder.final_layernorm.weight", hf=("model.norm.weight",),
                  kind=Kind.COPY, tp=TPLayout.REPLICATED)
OUTPUT = Rule(megatron="output_layer.weight", hf=("lm_head.weight",), kind=Kind.VOCAB, tp=TPLayout.ROWS,
              when=lambda cfg: not getattr(cfg, "tie_word_embeddings", False))


def qkv_bias(when: Callable[[Any], bool] = _always) -> Rule:
    return Rule(megatron=M + "self_attention.linear_qkv.bias",
                hf=tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"), kind=Kind.QKV, tp=TPLayout.ROWS,
                when=when)


def proj_bias(when: Callable[[Any], bool] = _always) -> Rule:
    return Rule(megatron=M + "self_attention.linear_proj.bias", hf=(L + "self_attn.o_proj.bias",),
                kind=Kind.COPY, tp=TPLayout.REPLICATED, when=when)
