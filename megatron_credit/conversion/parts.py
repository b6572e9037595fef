"""The HF -> megatron importer in parts of layers: host memory bounded by a part, not by the model.

A converted checkpoint is megatron's torch_dist format: each decoder weight is one global tensor with the
layer axis first (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: ``[layers, experts, ...]``),
stored as chunks (one per layer, and per expert), and ``.metadata`` (torch.distributed.checkpoint's
``Metadata``) says which file and byte range holds each chunk. So a checkpoint can be written a part at a
time: part ``p`` is a model of the layers ``[offset, offset + count)`` alone (the embedding only in the
first part, the final norm and the output layer only in the last), filled from the HF tensors and saved by
megatron as a checkpoint of its own; then :func:`merge_parts` moves every part's shard files into one
folder and writes one ``.metadata`` in which each part's chunks sit at their global layer offset:

* a tensor under ``decoder.layers.``: its global size's layer axis becomes the model's layer count and
  each chunk's (and each storage index's) layer offset moves by the part's offset;
* megatron's per-layer objects (``..._extra_state/shard_<layer>[.<expert>]_<layers>[.<experts>]``, empty
  without Transformer Engine) are renamed to their global layer;
* anything else belongs to one part only (the embedding, the final norm, the output layer).

The result loads as the one-part conversion does, at any TP / PP / EP (megatron reshards on load), and
equals it tensor for tensor (``tests/conversion/test_parts.py``). The peak host memory is one part of the
model in the target dtype, plus the embedding and the output layer in the first and last part, plus one
HF tensor in flight; :func:`layers_per_part` sizes the parts from ``--max-part-gib``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

_SHARD = re.compile(r"^(decoder\.layers\..*)/shard_(\d+)((?:\.\d+)*)_(\d+)((?:\.\d+)*)$")
"""megatron's ShardedObject key of a per-layer object: key/shard_<offsets>_<fragmentations>, the layer first."""


def layer_bytes(reader, family, cfg, dtype: torch.dtype) -> int:
    """Bytes of one decoder layer's weights in ``dtype``: layer 0's HF tensors (every layer has the same)."""
    from megatron_credit.conversion.streaming import expand_rules

    numel = 0
    for name, hf_names, rule in expand_rules(family, cfg):
        if rule.per_layer and ".layers.0." in name:
            for h in hf_names:
                shape = reader._info(h)[1]["shape"]
                numel += int(torch.Size(shape).numel())
    return numel * torch.empty(0, dtype=dtype).element_size()


def layers_per_part(num_layers: int, bytes_per_layer: int, max_part_bytes: float) -> int:
    """The most layers whose weights fit ``max_part_bytes`` (at least one, at most all).

    >>> layers_per_part(94, 5 << 30, 16 * 2**30), layers_per_part(94, 5 << 30, 1), layers_per_part(4, 1, 1e9)
    (3, 1, 4)
    """
    return max(1, min(num_layers, int(max_part_bytes // max(bytes_per_layer, 1))))


def part_config(cfg: Any, offset: int, count: int) -> Any:
    """``cfg`` for the layers ``[offset, offset + count)`` alone (per-layer lists sliced with them)."""
    part = copy.deepcopy(cfg)
    part.num_hidden_layers = count
    if isinstance(getattr(cfg, "layer_types", None), (list, tuple)):
        part.layer_types = list(cfg.layer_types[offset:offset + count])
    return part


def write_in_parts(out: Path, cfg: Any, family, *, get_hf: Callable[[str], torch.Tensor], params_dtype: torch.dtype,
                   per_part: int, save: Callable[[dict, Path], None]) -> int:
    """Write the dist checkpoint of ``cfg`` into the new folder ``out`` a part of ``per_part`` layers at a time
    (module docstring); ``save(sharded_state_dict, folder)`` is the converter's megatron save. Returns the
    number of parts. Runs inside the converter's single-stage parallel state."""
    from megatron_credit.conversion.live import load_hf_into_local_state
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from megatron_credit.recipe.config import ParallelConfig

    num_layers = cfg.num_hidden_layers
    plan = [(o, min(per_part, num_layers - o)) for o in range(0, num_layers, per_part)]
    staging = out.parent / f".{out.name}-parts"
    staging.mkdir(parents=True)
    try:
        parts = []
        for p, (offset, count) in enumerate(plan):
            pcfg = part_config(cfg, offset, count)
            tcfg = transformer_config_from_hf(pcfg, parallel=ParallelConfig(), params_dtype=params_dtype,
                                              perform_initialization=False)
            model = build_gpt_model(pcfg, tcfg, use_transformer_engine=False, pre_process=p == 0,
                                    post_process=p == len(plan) - 1)
            load_hf_into_local_state(model.state_dict(keep_vars=True), get_hf, family, cfg, tp_rank=0, tp_size=1,
                                     layer_offset=offset)
            folder = staging / f"part{p}"
            folder.mkdir()
            save(main_replicas(model.sharded_state_dict()), folder)
            del model
            parts.append((folder, offset, count))
        merge_parts(parts, out, num_layers=num_layers)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(plan)


def main_replicas(sharded_state_dict: dict) -> dict:
    """The entries a part writes itself: not the replicas of another part's tensor (a tied output layer on the
    last part is the embedding's replica, which the first part writes; megatron's save refuses a replica
    whose main copy it does not see)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    out = {}
    for k, v in sharded_state_dict.items():
        if isinstance(v, dict):
            v = main_replicas(v)
        elif isinstance(v, ShardedTensor) and not is_main_replica(v.replica_id):
            continue
        out[k] = v
    return out


def merge_parts(parts: list[tuple[Path, int, int]], out: Path, *, num_layers: int) -> None:
    """One dist checkpoint in ``out`` from the part checkpoints ``(folder, layer offset, layer count)``: their
    shard files moved (renamed ``__<part>_<n>.distcp``) and one ``.metadata`` (module docstring)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    out.mkdir(parents=True, exist_ok=True)
    merged: dict = {}
    storage: dict = {}
    planner: dict = {}
    first = None
    for p, (folder, offset, count) in enumerate(parts):
        md = FileSystemReader(str(folder)).read_metadata()
        first = first or md

        def name(fqn: str) -> str:
            m = _SHARD.match(fqn)
            if not m:
                return fqn
            if int(m.group(4)) != count:
                raise ValueError(f"merging part {p}: {fqn!r} is not a layer of a {count}-layer part")
            return f"{m.group(1)}/shard_{int(m.group(2)) + offset}{m.group(3)}_{num_layers}{m.group(5)}"

        def layered(fqn: str) -> bool:
            return fqn.startswith("decoder.layers.") and isinstance(md.state_dict_metadata[fqn], TensorStorageMetadata)

        def shift(offsets: torch.Size) -> torch.Size:
            return torch.Size([offsets[0] + offset, *offsets[1:]])

        files, again = {}, set()
        for f in sorted(os.listdir(folder)):
            if f.endswith(".distcp"):
                files[f] = f"__{p}_{len(files)}.distcp"
                os.replace(folder / f, out / files[f])
        for fqn, meta in md.state_dict_metadata.items():
            new = name(fqn)
            if layered(fqn):
                if meta.size[0] != count:
                    raise ValueError(f"merging part {p}: {fqn!r} has {meta.size[0]} layers, the part {count}")
                meta = TensorStorageMetadata(properties=meta.properties, size=torch.Size([num_layers, *meta.size[1:]]),
                                             chunks=[ChunkStorageMetadata(offsets=shift(c.offsets), sizes=c.sizes)
                                                     for c in meta.chunks])
            if new not in merged:
                merged[new] = meta
            elif isinstance(meta, TensorStorageMetadata) and merged[new].size == meta.size:
                merged[new].chunks.extend(meta.chunks)  # chunks two parts write (none cover the same elements)
            elif not isinstance(meta, TensorStorageMetadata) and not new.startswith("decoder.layers."):
                again.add(fqn)  # an object every part saves (megatron's common state): the first part's
            else:
                raise ValueError(f"merging part {p}: {new!r} is written by an earlier part too")
        for idx, info in md.storage_data.items():
            if idx.fqn in again:
                continue
            at = shift(idx.offset) if idx.offset is not None and layered(idx.fqn) else idx.offset
            storage[MetadataIndex(fqn=name(idx.fqn), offset=at, index=idx.index)] = dataclasses.replace(
                info, relative_path=files[info.relative_path])
        for fqn, path in (md.planner_data or {}).items():
            planner[name(fqn)] = tuple(name(x) if isinstance(x, str) else x for x in path)
    with open(out / ".metadata", "wb") as f:  # as torch's FileSystemWriter writes it: a pickled Metadata
        pickle.dump(dataclasses.replace(first, state_dict_metadata=merged, storage_data=storage,
                                        planner_data=planner), f)
    for extra in ("metadata.json", "common.pt"):  # megatron's format record and common state: one per part, alike
        if (parts[0][0] / extra).is_file():
            shutil.copyfile(parts[0][0] / extra, out / extra)
