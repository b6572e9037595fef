"""What a model family is: its config facts, its megatron spec choices and its HF <-> megatron weight map.

A family is one file, ``families/<family>.py``, registering one :class:`Family` (or an instance of a
subclass that overrides a hook) under its HF ``model_type``, in the manner of Megatron-Bridge's bridges:

* config facts: the HF architecture class it accepts, what it means for megatron's ``TransformerConfig``
  (:meth:`Family.transformer_config_kwargs`: QKV bias, q/k layernorm, the MoE fields) and the settings
  megatron cannot reproduce (:meth:`Family.refuse`), and the parameters it adds to a layer for the planner
  (:meth:`Family.extra_layer_params`);
* spec choices: what the layer spec needs beyond the dense local/TE spec is read from those
  ``TransformerConfig`` fields (``qk_layernorm``, ``num_moe_experts``) by ``models/gpt.gpt_layer_spec``, so
  the family states each choice once; how routed experts run (``moe_grouped_gemm``: TE's grouped GEMM with
  the TE spec, one linear per expert with the local one) is the spec's, not the family's
  (``models/hf_config.transformer_config_from_hf``);
* the weight map: a tuple of :class:`Rule`: one megatron parameter <- one or more HF tensors, a
  :class:`Kind` of transform and the parameter's :class:`TPSplit`. A rule whose megatron name holds
  ``{i}`` is repeated for every decoder layer (global numbering, that of a TP = PP = 1 model and of the
  dist checkpoint); one that also holds ``{e}`` for every routed expert of the layer. Optional parameters
  (biases, q/k norms, the untied output layer) carry a ``when`` predicate on the HF config. A parameter
  named differently under Transformer Engine's spec carries that name too: ``te_megatron`` (a norm fused
  into the next linear) and ``grouped_megatron`` (a routed expert's linear under TE's grouped GEMM,
  megatron's ``TEGroupedMLP``: one ``linear_fc1.weight{e}`` per expert where ``SequentialMLP`` has
  ``local_experts.{e}.linear_fc1.weight``).

This folder sits low in the house: it imports torch-free Python only (the registry), so ``models/``
(the ``TransformerConfig``), ``planning/`` (parameter counts) and ``conversion/`` (the transforms) all
read one file per family. Nothing outside a family's file asks which family a config is.

>>> FAMILIES.get("gpt2")
Traceback (most recent call last):
...
ValueError: unknown model family 'gpt2'; valid names: [...]
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_credit.registry import Registry


class TPSplit(enum.Enum):
    """How a megatron parameter is partitioned over tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds the full tensor (norms, row-parallel biases, the router)
    ROWS = "rows"              # column-parallel linear / vocab-parallel embedding: dim 0 split in order
    COLS = "cols"              # row-parallel linear: dim 1 split in order
    GATED_ROWS = "gated_rows"  # fc1 of a gated MLP: rank r holds [gate_r; up_r]


class Kind(enum.Enum):
    """How the HF tensors of a rule become the megatron tensor."""

    COPY = "copy"        # one HF tensor, same shape
    QKV = "qkv"          # (q, k, v) -> linear_qkv, rows grouped per query group
    GATE_UP = "gate_up"  # (gate, up) -> linear_fc1 = [gate; up]
    VOCAB = "vocab"      # one HF tensor [V, hidden]; megatron may hold padded rows [V_pad, hidden]



def __getattr__(name: str):
    """``TPLayout``, :class:`TPSplit`'s old name, for one release, with a warning (family plugins import it)."""
    if name == "TPLayout":
        import warnings

        warnings.warn("megatron_credit.families.base.TPLayout is now TPSplit; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return TPSplit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

def _always(cfg: Any) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Name in a local-spec GPTModel state dict; ``{i}`` is the global layer index, ``{e}`` the expert."""
    hf: tuple[str, ...]
    """HF names (``{i}``, ``{e}`` likewise), in the order the transform takes them."""
    kind: Kind
    """Transform from the HF tensors to the megatron one (and back)."""
    tp: TPSplit
    """How megatron partitions this parameter over TP ranks."""
    te_megatron: str | None = None
    """Name under the Transformer Engine spec when it differs (fused layer norms)."""
    grouped_megatron: str | None = None
    """Name under TE's grouped experts (``TEGroupedMLP``, ``moe_grouped_gemm``) when it differs: a routed
    expert's linear, ``{e}`` the expert (local to its EP rank in a rank's state dict, as ``megatron``'s)."""
    when: Callable[[Any], bool] = field(default=_always)
    """Predicate on the HF config: is this parameter present?"""

    def megatron_name(self, *, fused_norms: bool, grouped_experts: bool = False) -> str:
        """The name in a model with TE's fused norms (``fused_norms``) and grouped experts (``grouped_experts``)."""
        if grouped_experts and self.grouped_megatron:
            return self.grouped_megatron
        return self.te_megatron if fused_norms and self.te_megatron else self.megatron

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.megatron


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: the HF architectures it accepts, its config facts, tiny test config and weight rules.

    Every family is a pre-norm RMSNorm decoder with a SwiGLU MLP, GQA and RoPE on the whole head; the
    fields and hooks below are where the families differ. A family with more to say (a refusal, MoE
    fields) is a subclass overriding a hook, registered like the others.
    """

    name: str
    """Registry key: the HF ``config.model_type`` (the key of an inline ``model.architecture``)."""
    architectures: tuple[str, ...]
    """HF ``config.architectures`` entries (``transformers`` classes) handled by this family."""
    rules: tuple[Rule, ...]
    """The weight map (see the module docstring)."""
    qkv_bias: bool = False
    """Bias on q, k and v whatever the config says (Qwen2), none on o_proj or the MLP."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3), weights ``[head_dim]`` each."""
    tiny_config: dict[str, Any] = field(default_factory=dict, hash=False)
    """Fields of :func:`~megatron_credit.conversion.testing.tiny_hf_config` that differ from its defaults."""

    def active_rules(self, cfg: Any) -> list[Rule]:
        return [r for r in self.rules if r.when(cfg)]

    def refuse(self, cfg: Any) -> Optional[str]:
        """A family setting megatron cannot reproduce: a one-line reason naming the field, or None."""
        return None

    def check_config(self, cfg: Any) -> None:
        """Refuse (``ValueError``, one line naming the field) a setting the megatron model cannot reproduce."""
        refused = self.refuse(cfg)
        if refused:
            raise ValueError(refused)

    def transformer_config_kwargs(self, cfg: Any) -> dict[str, Any]:
        """``TransformerConfig`` fields this family sets beyond the shared dense decoder (``models/hf_config``)."""
        return {"qk_layernorm": self.qk_layernorm}

    def num_experts(self, cfg: Any) -> int:
        """Routed experts per MoE layer (0: a dense family); the ``{e}`` rules repeat this many times."""
        return 0

    def expert_ffn_hidden_size(self, cfg: Any) -> int:
        """Width of one routed expert's gate / up projections (0: a dense family)."""
        return 0

    def extra_layer_params(self, *, qkv_rows: int, head_dim: int) -> int:
        """Parameters of one layer on one TP rank beyond the shared architecture: the QKV bias (``qkv_rows``,
        this rank's rows of ``linear_qkv``) and the q/k norms (replicated, ``head_dim`` each)."""
        return (qkv_rows if self.qkv_bias else 0) + (2 * head_dim if self.qk_layernorm else 0)


FAMILIES: Registry[Family] = Registry("model family")
_ORDER: list[str] = []  # registration order, the order error messages list the supported types in

REFUSED_MODEL_TYPES = {
    model_type: f"{name} needs {why}, which the megatron layer specs here do not have"
    for name, why, types in [
        ("Gemma", "RMSNorm with a (1 + weight) gain on the norms and embeddings scaled by sqrt(hidden_size)",
         ("gemma",)),
        ("Gemma 2", "post-attention and post-MLP norms, embeddings scaled by sqrt(hidden_size) and logit "
         "soft-capping", ("gemma2",)),
        ("Gemma 3", "post-attention and post-MLP norms, embeddings scaled by sqrt(hidden_size) and "
         "interleaved sliding-window layers", ("gemma3", "gemma3_text")),
    ]
    for model_type in types
}
"""Families refused with the reason (``docs/conversion.md`` says which megatron feature is missing)."""


def register_family(family: Family) -> Family:
    FAMILIES.add(family.name, family)
    _ORDER.append(family.name)
    return family


def _load_families() -> None:
    import megatron_credit.families  # noqa: F401 - importing the package registers the families


def family_of(model_type: Any) -> Family:
    """The family registered for ``model_type``; a ``ValueError`` naming the field and the supported types."""
    _load_families()
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"hf_config.model_type={model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"hf_config.model_type={model_type!r} is not supported; "
                         f"supported: {list(supported_model_types())}")
    return FAMILIES.get(model_type)


def supported_model_types() -> tuple[str, ...]:
    """The registered model types, in registration order (qwen2, qwen3, llama, mistral, ...)."""
    _load_families()
    return tuple(n for n in _ORDER if n in FAMILIES)


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(a for n in FAMILIES for a in FAMILIES.get(n).architectures)


def family_for_config(cfg: Any) -> Family:
    """The family whose architectures include the config's, its settings checked (``Family.check_config``);
    a clear error listing the supported ones, or saying why a known family (Gemma) is refused."""
    _load_families()
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    if isinstance(model_type, str) and model_type in REFUSED_MODEL_TYPES:
        family_of(model_type)  # raises the reason
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
