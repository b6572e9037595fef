"""Tiny HF configs per family and a streaming writer of random HF checkpoints (tests, benchmarks).

Nothing here downloads: configs are built from ``transformers`` config classes, and random checkpoints
are written tensor by tensor (shapes from a model instantiated on the ``meta`` device), so a ~1B model
can be generated with one tensor in memory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_credit.conversion.hf_io import ShardedSafetensorsWriter

def tiny_hf_config(family: str, **overrides: Any):
    """A small random-init config of ``family`` (a registered family name); GQA with 2 groups.

    The family's ``Family.tiny_config`` (in its ``families/<family>.py``) adds what differs from the shared fields
    here (Qwen3's and Mistral's decoupled head_dim, Llama's llama3 RoPE scaling).
    """
    from transformers import AutoConfig

    from megatron_credit.families import FAMILIES

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {FAMILIES.names()}")
    fam = FAMILIES.get(family)
    kw: dict[str, Any] = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=[fam.architectures[0]])
    kw.update(fam.tiny_config)
    kw.update(overrides)
    return AutoConfig.for_model(family, **kw)


def hf_parameter_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF state-dict names and shapes of ``cfg``'s model, without allocating it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    for k, v in model.state_dict().items():
        shapes.update(_checkpoint_expert_shapes(k, tuple(v.shape)) or {k: tuple(v.shape)})
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _checkpoint_expert_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
    """transformers 5 holds a layer's routed experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]) and saves them per expert (``mlp.experts.{e}.gate_proj.weight``
    [I, H], ``up_proj``, ``down_proj`` [H, I]), the checkpoints' names; None for any other tensor."""
    if name.endswith("mlp.experts.gate_up_proj") and len(shape) == 3:
        n, rows, cols = shape
        return {f"{name[:-len('gate_up_proj')]}{e}.{p}_proj.weight": (rows // 2, cols)
                for e in range(n) for p in ("gate", "up")}
    if name.endswith("mlp.experts.down_proj") and len(shape) == 3:
        return {f"{name[:-len('down_proj')]}{e}.down_proj.weight": shape[1:] for e in range(shape[0])}
    return None


def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's ``state_dict()`` under its checkpoint's names: stacked experts split per
    expert (``gate_up_proj[e]`` is ``[gate; up]``, as transformers 5 concatenates them on load)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        names = _checkpoint_expert_shapes(k, tuple(v.shape))
        if names is None:
            out[k] = v
            continue
        halves = [t for e in range(v.shape[0]) for t in (v[e].chunk(2, dim=0) if k.endswith("gate_up_proj") else (v[e],))]
        out.update({n: t.contiguous() for n, t in zip(names, halves, strict=True)})
    return out


def write_random_hf_checkpoint(cfg: Any, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                               seed: int = 0, max_shard_bytes: int = 2 * 1024**3, std: float = 0.02) -> int:
    """Write ``config.json`` and random safetensors shards for ``cfg``; returns the weight bytes.

    Norm weights are ``1 + noise`` so that they are not all equal; everything else is N(0, std).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardedSafetensorsWriter(out, max_shard_bytes=max_shard_bytes)
    for name, shape in hf_parameter_shapes(cfg).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        if name.endswith("norm.weight"):
            t += 1.0
        writer.add(name, t.to(dtype))
        del t
    writer.close()
    cfg_dict = cfg.to_dict()
    cfg_dict["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    return writer.total_bytes


def rewrite_common_state(model_dir: str | os.PathLike, fmt: str) -> None:
    """Rewrite the dist checkpoint folder ``model_dir`` in place into one of megatron's two formats of
    the common (non-tensor) state, whichever megatron-core wrote it:

    - ``"0.19"``: what megatron-core 0.19.2 writes (checked against a checkpoint it saved): no
      ``common.pt``; the common state dict ``c`` stored as ``torch.save([c])``, the byte item
      ``common_state/shard_0_1`` (``BytesStorageMetadata``) of ``__0_0.distcp``; ``metadata.json``
      ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}``;
    - ``"0.16"``: what 0.16.1 writes: ``torch.save(c)`` as ``common.pt``, no ``common_state`` item,
      ``metadata.json`` naming the torch common backend too.

    A no-op when the folder is in that format already."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from megatron_credit.conversion.safe_load import (COMMON_NAME, COMMON_STATE_KEY, MEGATRON_META_NAME,
                                                      METADATA_NAME, read_dist_metadata)

    model_dir = Path(model_dir)
    md = read_dist_metadata(model_dir)
    has_item = COMMON_STATE_KEY in md.state_dict_metadata
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    if fmt == "0.19":
        if has_item and not (model_dir / COMMON_NAME).exists():
            return
        common = torch.load(model_dir / COMMON_NAME, weights_only=True)
        buf = io.BytesIO()
        torch.save([common], buf)
        data = model_dir / "__0_0.distcp"
        offset = data.stat().st_size
        with open(data, "ab") as f:
            f.write(buf.getvalue())
        md.state_dict_metadata[COMMON_STATE_KEY] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(COMMON_STATE_KEY)] = _StorageInfo(
            relative_path=data.name, offset=offset, length=len(buf.getvalue()))
        (model_dir / COMMON_NAME).unlink()
    elif fmt == "0.16":
        if (model_dir / COMMON_NAME).exists() and not has_item:
            return
        (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == COMMON_STATE_KEY]
        with open(model_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            common, = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        torch.save(common, model_dir / COMMON_NAME)
        del md.state_dict_metadata[COMMON_STATE_KEY], md.storage_data[index]
        backend.update(common_backend="torch", common_backend_version=1)
    else:
        raise ValueError(f"format {fmt!r} is not '0.16' or '0.19'")
    (model_dir / METADATA_NAME).write_bytes(pickle.dumps(md))
    (model_dir / MEGATRON_META_NAME).write_text(json.dumps(backend))
