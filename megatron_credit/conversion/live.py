"""HF weights in and out of a live, TP/PP-sharded megatron model (one rank's local state dict).

* :func:`load_hf_into_local_state` fills a rank's parameters from HF tensors (used by the converter
  and by the parity tests), slicing each full tensor to the rank's TP shard.
* :func:`iter_hf_weight_buckets` is the weight-sync source of the rollout engines: it walks the HF
  names in order, gathers each parameter over TP on the pipeline stage that owns it, broadcasts it over
  PP, converts it to HF names and shapes and yields size-bounded buckets of ``(hf_name, tensor)``. Every rank
  yields the same buckets, so the engine may read them on any rank. At most one bucket plus one
  gathered parameter is alive at a time.

A rank's state dict numbers its decoder layers locally (0 .. layers_per_stage - 1); ``layer_offset``
(the global index of its first layer, megatron's ``get_transformer_layer_offset``) is passed in. Its
routed experts are numbered locally too (``0 .. E / EP - 1``: EP rank ``r`` holds the global experts
``r E / EP ...``), under either of megatron's names: ``mlp.experts.local_experts.{e}.linear_fc1.weight``
(``SequentialMLP``) or ``mlp.experts.linear_fc1.weight{e}`` (``TEGroupedMLP``, TE's grouped GEMM). The
state dict says which (:func:`uses_grouped_experts`), as it says whether the norms are fused.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from megatron_credit.conversion.base import ModelDims
from megatron_credit.families.base import Family, Kind
from megatron_credit.conversion.streaming import expand_rules, rule_to_hf, rule_to_megatron
from megatron_credit.conversion.transforms import TPSplit, pad_rows, tp_gather, tp_shard
from megatron_credit.rollout.weight_sync import group_buckets

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")  # SequentialMLP
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")  # TEGroupedMLP


def uses_fused_norms(local_state: Mapping[str, Any]) -> bool:
    """True for a Transformer Engine spec model (layer norms fused into linear_qkv / linear_fc1)."""
    return any(k.endswith(".layer_norm_weight") for k in local_state)


def parameter_names(local_state: Mapping[str, Any]) -> list[str]:
    """The weight entries of a state dict (TE's ``_extra_state`` entries carry no weights)."""
    return [k for k in local_state if not k.endswith("_extra_state")]


def to_global_name(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.3.x`` on a stage whose first layer is 8 -> ``decoder.layers.11.x``."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)


def to_local_name(global_name: str, layer_offset: int) -> str:
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) - layer_offset}.", global_name)


def uses_grouped_experts(local_state: Mapping[str, Any]) -> bool:
    """True for a model whose routed experts are TE's grouped GEMM (``mlp.experts.linear_fc1.weight0``)."""
    return any(_GROUPED_EXPERT.search(k) for k in local_state)


def expert_of(name: str) -> int | None:
    """The routed expert's index in a parameter name (``SequentialMLP``'s or ``TEGroupedMLP``'s), or None."""
    m = _EXPERT.search(name)
    if m:
        return int(m.group(1))
    m = _GROUPED_EXPERT.search(name)
    return int(m.group(2)) if m else None


def with_expert(name: str, expert: int) -> str:
    """``name`` with its routed expert's index replaced by ``expert`` (the same naming kept)."""
    name = _EXPERT.sub(f".mlp.experts.local_experts.{expert}.", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{expert}", name)


def _local_experts(dims: ModelDims, ep_size: int) -> int:
    return dims.num_experts // ep_size if dims.num_experts else 0


@torch.no_grad()
def load_hf_into_local_state(local_state: Mapping[str, torch.Tensor], get_hf: Callable[[str], torch.Tensor],
                             family: Family, cfg: Any, *, tp_rank: int, tp_size: int, layer_offset: int,
                             ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy HF tensors into this rank's parameters (in place), each sliced to its TP shard.

    Under expert parallelism (``ep_size`` > 1) this rank holds the routed experts
    ``ep_rank * E / ep_size ...`` as its local experts ``0 ... E / ep_size - 1``; the others are skipped.

    ``local_state`` maps local names to the live parameter tensors (``dict(model.named_parameters())``
    or ``model.state_dict(keep_vars=True)``). The vocabulary is zero-padded to the model's rows.
    A tied output layer on the last stage (PP > 1) is filled from the embedding. Every local parameter
    must be filled: a leftover means the map and the model disagree.
    """
    dims = ModelDims.from_hf_config(cfg)
    fused, grouped = uses_fused_norms(local_state), uses_grouped_experts(local_state)
    local_names = set(parameter_names(local_state))
    todo = set(local_names)
    per_rank = _local_experts(dims, ep_size)
    for name, hf_names, rule in expand_rules(family, cfg, fused_norms=fused, grouped_experts=grouped):
        local = to_local_name(name, layer_offset)
        if rule.per_expert:
            e = expert_of(local) - ep_rank * per_rank
            if not 0 <= e < per_rank:
                continue  # another EP rank's expert
            local = with_expert(local, e)
        targets = [local]
        if rule.megatron == "embedding.word_embeddings.weight" and dims.tie_word_embeddings:
            targets.append("output_layer.weight")  # the last stage's copy of a tied head
        targets = [t for t in targets if t in local_names]
        if not targets:
            continue
        full = rule_to_megatron(rule, [get_hf(h) for h in hf_names], dims, name=name)
        for t in targets:
            dst = local_state[t]
            if rule.kind is Kind.VOCAB:
                full_rows = dst.shape[0] * tp_size
                shard = tp_shard(pad_rows(full, full_rows), rule.tp, rank=tp_rank, size=tp_size)
            else:
                shard = tp_shard(full, rule.tp, rank=tp_rank, size=tp_size)
            if shard.shape != dst.shape:
                raise ValueError(f"{t}: converted shard {tuple(shard.shape)} != parameter {tuple(dst.shape)} "
                                 f"(tp_rank={tp_rank}/{tp_size})")
            dst.copy_(shard)
            todo.discard(t)
    if todo:
        raise ValueError(f"parameters not filled from the HF checkpoint: {sorted(todo)[:5]}")


def _plan(local_state: Mapping[str, torch.Tensor], layer_offset: int, pp_group,
          expert_offset: int = 0) -> dict[str, tuple[int, tuple, Any]]:
    """Global name -> (PP-group rank that owns it, full-ish local shape, dtype), agreed by all stages."""
    import torch.distributed as dist

    def global_name(k: str) -> str:  # the PP group's ranks hold the same EP rank's experts
        e = expert_of(k)
        return to_global_name(k if e is None else with_expert(k, e + expert_offset), layer_offset)

    mine = {global_name(k): (tuple(local_state[k].shape), local_state[k].dtype) for k in parameter_names(local_state)}
    size = 1 if pp_group is None else dist.get_world_size(pp_group)
    gathered: list = [mine] if size == 1 else [None] * size
    if size > 1:
        dist.all_gather_object(gathered, mine, group=pp_group)
    plan: dict[str, tuple[int, tuple, Any]] = {}
    for stage, names in enumerate(gathered):
        for name, (shape, dtype) in names.items():
            if name in plan:
                # Only a tied head lives on two stages (the last stage's copy of the embedding); the
                # first stage wins. Anything else means a wrong layer_offset or a mis-built model.
                if name != "output_layer.weight":
                    raise ValueError(f"pipeline stages {plan[name][0]} and {stage} both hold {name!r}: "
                                     "is layer_offset right on every stage?")
                continue
            plan[name] = (stage, shape, dtype)
    return plan


def _gather_tp(t: torch.Tensor, split, tp_group) -> torch.Tensor:
    import torch.distributed as dist

    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=tp_group)
    return tp_gather(shards, split)


@torch.no_grad()
def iter_hf_weight_buckets(local_state: Mapping[str, torch.Tensor], family: Family, cfg: Any, *, tp_group=None,
                           pp_group=None, ep_group=None, layer_offset: int = 0,
                           bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full tensor)`` of whole sync groups (:func:`~megatron_credit.rollout.weight_sync.sync_group`: one decoder
    layer, or one other tensor) whose total size is at most ``bucket_bytes``.

    A bucket closes only between groups, so a single group larger than ``bucket_bytes`` is a bucket of
    its own and a fused group (q/k/v, gate/up) is never split. All ranks of the TP and PP
    groups must call this together (it runs collectives); ``None`` groups mean size 1. Buckets are
    in HF order (embedding, layers, final norm, head) and the same on every rank. Any yielded tensor
    may alias a parameter's memory (no gather or copying transform is guaranteed: TP = 1, norms, a
    split of a fused tensor may be a view): consume (copy / send) a bucket before the parameters change,
    and never write into it. One model chunk per rank (no virtual PP). Under expert parallelism
    (``ep_group``) a routed expert is broadcast over EP from the rank that holds it.
    """
    import torch.distributed as dist

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    dims = ModelDims.from_hf_config(cfg)
    fused, grouped = uses_fused_norms(local_state), uses_grouped_experts(local_state)
    pp_rank = 0 if pp_group is None else dist.get_rank(pp_group)
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    names = parameter_names(local_state)
    device = local_state[names[0]].device if names else torch.device("cpu")

    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    per_rank = _local_experts(dims, ep_size)
    plan = _plan(local_state, layer_offset, pp_group, expert_offset=ep_rank * per_rank)

    def hf_tensors():
        for name, hf_names, rule in expand_rules(family, cfg, fused_norms=fused, grouped_experts=grouped):
            ep_owner, key, local = ep_rank, name, to_local_name(name, layer_offset)
            if rule.per_expert:  # the plan names this EP rank's experts; the EP owner holds this one
                ep_owner, e = divmod(expert_of(name), per_rank)
                key, local = with_expert(name, e + ep_rank * per_rank), with_expert(local, e)
            if key not in plan:
                raise ValueError(f"no pipeline stage holds {name!r}; is the model built for this config?")
            owner, shape, dtype = plan[key]
            if owner == pp_rank and ep_owner == ep_rank:
                full = _gather_tp(local_state[local], rule.tp, tp_group)
            else:
                full = torch.empty(_full_shape(shape, rule.tp, tp_size), dtype=dtype, device=device)
            if owner == pp_rank and ep_size > 1 and rule.per_expert:
                dist.broadcast(full, src=dist.get_global_rank(ep_group, ep_owner), group=ep_group)
            if pp_group is not None and dist.get_world_size(pp_group) > 1:
                dist.broadcast(full, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            yield from zip(hf_names, rule_to_hf(rule, full, dims, name=name), strict=True)

    yield from group_buckets(hf_tensors(), bucket_bytes=bucket_bytes)


def _full_shape(local_shape: tuple, split, tp_size: int) -> tuple:
    if split is TPSplit.REPLICATED or tp_size == 1:
        return local_shape
    dim = 1 if split is TPSplit.COLS else 0
    return tuple(s * tp_size if d == dim else s for d, s in enumerate(local_shape))
