"""The architecture facts of each model family that the model layer and the planner need.

A family's one file is ``megatron_credit/conversion/<family>.py``: its HF architecture name, weight
rules and tiny test config, plus the :class:`ArchFacts` declared here, which it holds as ``Family.arch``.
The facts are declared in the models layer, not in that file, because ``models/hf_config.py`` (the
``TransformerConfig``) and ``planning.py`` (the parameter count) read them and ``conversion/`` imports
``models/`` (it builds a model to load a checkpoint into): reading them from ``conversion/`` would close
an import cycle. Nothing outside a family's facts asks which family a config is.

>>> arch_facts("qwen2").qkv_bias, arch_facts("qwen3").qk_layernorm
(True, True)
>>> arch_facts("gemma2")
Traceback (most recent call last):
...
ValueError: hf_config.model_type='gemma2' is not supported: Gemma 2 needs post-attention and post-MLP norms, embeddings scaled by sqrt(hidden_size) and logit soft-capping, which the megatron layer specs here do not have
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_credit.registry import Registry


def _accept(hf_config: Any) -> Optional[str]:
    return None


@dataclass(frozen=True, kw_only=True)
class ArchFacts:
    """What one HF ``model_type`` means for megatron's ``TransformerConfig`` and the parameter count.

    Every family is a pre-norm RMSNorm decoder with a SwiGLU MLP, GQA and RoPE on the whole head; the
    fields below are where the families differ.
    """

    model_type: str
    """HF ``config.model_type`` (the key of an inline ``model.architecture``)."""
    architecture: str
    """HF ``config.architectures`` entry (the ``transformers`` class) of the family."""
    qkv_bias: bool = False
    """Bias on q, k and v whatever the config says (Qwen2), none on o_proj or the MLP."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3), weights ``[head_dim]`` each."""
    refuse: Callable[[Any], Optional[str]] = field(default=_accept)
    """Family settings megatron cannot reproduce: a one-line reason naming the field, or None."""

    def extra_layer_params(self, *, qkv_rows: int, head_dim: int) -> int:
        """Parameters of one layer on one TP rank beyond the shared layout: the QKV bias (``qkv_rows``,
        this rank's rows of ``linear_qkv``) and the q/k norms (replicated, ``head_dim`` each)."""
        return (qkv_rows if self.qkv_bias else 0) + (2 * head_dim if self.qk_layernorm else 0)


ARCH_FACTS: Registry[ArchFacts] = Registry("model_type")
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


def register_arch_facts(facts: ArchFacts) -> ArchFacts:
    ARCH_FACTS.add(facts.model_type, facts)
    _ORDER.append(facts.model_type)
    return facts


def arch_facts(model_type: Any) -> ArchFacts:
    """The facts of ``model_type``; a ``ValueError`` naming the field and the supported types."""
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"hf_config.model_type={model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in ARCH_FACTS:
        raise ValueError(f"hf_config.model_type={model_type!r} is not supported; "
                         f"supported: {list(supported_model_types())}")
    return ARCH_FACTS.get(model_type)


def supported_model_types() -> tuple[str, ...]:
    """The registered model types, in registration order (qwen2, qwen3, llama, mistral)."""
    return tuple(_ORDER)


def _mistral_sliding_window(hf_config: Any) -> Optional[str]:
    """Mistral's ``sliding_window`` lets query ``q`` see key ``k`` when ``q - k < sliding_window``. The
    model is never run past ``max_position_embeddings`` (``check_sequence_length``), so a window of at
    least that many positions is full causal attention, exactly; a smaller one is refused (the megatron
    actor attends to every earlier token on every layer)."""
    window = getattr(hf_config, "sliding_window", None)
    max_pos = getattr(hf_config, "max_position_embeddings", None)
    if window is not None and (max_pos is None or int(window) < int(max_pos)):
        return (f"hf_config.sliding_window={window} is not supported: the megatron actor uses full causal "
                f"attention, so sliding_window must be null or >= max_position_embeddings={max_pos}")
    return None


QWEN2 = register_arch_facts(ArchFacts(model_type="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True))
QWEN3 = register_arch_facts(ArchFacts(model_type="qwen3", architecture="Qwen3ForCausalLM", qk_layernorm=True))
LLAMA = register_arch_facts(ArchFacts(model_type="llama", architecture="LlamaForCausalLM"))
MISTRAL = register_arch_facts(ArchFacts(model_type="mistral", architecture="MistralForCausalLM",
                                        refuse=_mistral_sliding_window))
