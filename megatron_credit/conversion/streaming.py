"""Tensor-by-tensor conversion between full HF and full megatron state dicts.

Nothing here holds more than one rule's tensors at a time: the source is a ``get(name) -> Tensor``
callable (a lazy safetensors reader, a model's state dict) and the result is a generator, so a
converter's peak memory is one model copy (the destination) plus one parameter in flight.

Megatron names use the global layer numbering of a TP = PP = 1 model (that of the dist checkpoint);
:mod:`megatron_credit.conversion.live` maps them to a rank's local names. ``fused_norms`` and
``grouped_experts`` pick the names of a Transformer Engine model (its fused layer norms; routed experts as
TE's grouped GEMM, ``TEGroupedMLP``): the tensors and transforms are the same, only the names differ
(``families/base.Rule.megatron_name``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from megatron_credit.conversion.base import ModelDims
from megatron_credit.families.base import Family, Kind, Rule
from megatron_credit.conversion.transforms import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

# HF keys that carry no weights a megatron model needs (buffers some old checkpoints saved).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def expand_rules(family: Family, cfg: Any, *, fused_norms: bool = False,
                 grouped_experts: bool = False) -> list[tuple[str, tuple[str, ...], Rule]]:
    """``(megatron name, hf names, rule)`` for every parameter, decoder layers (and each layer's routed
    experts) expanded in order; the names of a model with TE's fused norms / grouped experts when asked."""
    dims = ModelDims.from_hf_config(cfg)
    out = []
    rules = family.active_rules(cfg)

    def name(r: Rule) -> str:
        return r.megatron_name(fused_norms=fused_norms, grouped_experts=grouped_experts)

    for r in (r for r in rules if not r.per_layer and not r.megatron.startswith("output_layer")
              and not r.megatron.startswith("decoder.final")):
        out.append((name(r), r.hf, r))
    for i in range(dims.num_layers):
        for r in (r for r in rules if r.per_layer):
            # A routed expert's rule repeats per expert, in place: one expert's tensors in flight at a time.
            for e in range(dims.num_experts) if r.per_expert else (0,):
                out.append((name(r).format(i=i, e=e), tuple(h.format(i=i, e=e) for h in r.hf), r))
    for r in (r for r in rules if not r.per_layer and (r.megatron.startswith("output_layer")
                                                        or r.megatron.startswith("decoder.final"))):
        out.append((name(r), r.hf, r))
    return out


def rule_to_megatron(rule: Rule, hf_tensors: list[torch.Tensor], dims: ModelDims, *,
                     name: str | None = None) -> torch.Tensor:
    """The full megatron tensor of one rule (vocabulary rows unpadded); ``name`` is used in errors."""
    if rule.kind is Kind.QKV:
        q, k, v = hf_tensors
        return fuse_qkv(q, k, v, num_heads=dims.num_heads, num_query_groups=dims.num_query_groups,
                        head_dim=dims.head_dim, name=name or rule.megatron)
    if rule.kind is Kind.GATE_UP:
        return fuse_gate_up(*hf_tensors)
    (t,) = hf_tensors
    return t


def rule_to_hf(rule: Rule, tensor: torch.Tensor, dims: ModelDims, *, name: str | None = None) -> list[torch.Tensor]:
    """Inverse of :func:`rule_to_megatron`; vocabulary padding rows are dropped; ``name`` is used in errors."""
    if rule.kind is Kind.QKV:
        return list(split_qkv(tensor, num_heads=dims.num_heads, num_query_groups=dims.num_query_groups,
                              head_dim=dims.head_dim, name=name or rule.megatron))
    if rule.kind is Kind.GATE_UP:
        return list(split_gate_up(tensor))
    if rule.kind is Kind.VOCAB:
        if tensor.shape[0] < dims.vocab_size:
            raise ValueError(f"{rule.megatron}: {tensor.shape[0]} rows < vocab_size={dims.vocab_size}")
        return [tensor[: dims.vocab_size]]
    return [tensor]


def check_hf_keys(keys: Iterable[str], family: Family, cfg: Any) -> None:
    """Every tensor the family needs is present, and no present tensor would be silently dropped."""
    needed = {h for _, hs, _ in expand_rules(family, cfg) for h in hs}
    present = set(keys)
    missing = sorted(needed - present)
    if missing:
        raise ValueError(f"{len(missing)} tensors missing from the HF checkpoint for family "
                         f"{family.name!r}, e.g. {missing[:5]}")
    ignorable = {k for k in present if k.endswith(_IGNORED_HF_SUFFIXES)}
    if getattr(cfg, "tie_word_embeddings", False):
        ignorable.add("lm_head.weight")  # some tied checkpoints still store the (identical) head
    unexpected = sorted(present - needed - ignorable)
    if unexpected:
        raise ValueError(f"{len(unexpected)} HF tensors have no rule in family {family.name!r} (they would be "
                         f"lost), e.g. {unexpected[:5]}")


def iter_megatron_from_hf(get_hf: Callable[[str], torch.Tensor], family: Family, cfg: Any, *,
                          fused_norms: bool = False, grouped_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(global megatron name, full tensor)``, reading each HF tensor once via ``get_hf``."""
    dims = ModelDims.from_hf_config(cfg)
    for name, hf_names, rule in expand_rules(family, cfg, fused_norms=fused_norms, grouped_experts=grouped_experts):
        yield name, rule_to_megatron(rule, [get_hf(h) for h in hf_names], dims, name=name)


def iter_hf_from_megatron(get_megatron: Callable[[str], torch.Tensor], family: Family, cfg: Any, *,
                          fused_norms: bool = False, grouped_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor)`` from full megatron tensors fetched by global name."""
    dims = ModelDims.from_hf_config(cfg)
    for name, hf_names, rule in expand_rules(family, cfg, fused_norms=fused_norms, grouped_experts=grouped_experts):
        yield from zip(hf_names, rule_to_hf(rule, get_megatron(name), dims, name=name), strict=True)
