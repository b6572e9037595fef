"""What the tests of sharded megatron models share (``tests/models/test_parallel_invariance.py``,
``test_concentration.py``): the tiny Qwen2 they build, a parameter's TP shard cut from the full tensor and
gathered back (megatron's split, written here apart from the code under test), and the world-size-1 name
of a sharded parameter."""
from __future__ import annotations

import re

import torch

QWEN2 = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


def global_name(model, name: str) -> str:
    """Rename ``decoder.layers.<local>.`` to the global layer index of this pipeline stage."""
    m = re.match(r"(.*decoder\.layers\.)(\d+)(\..*)", name)
    if not m:
        return name
    layer = model.decoder.layers[int(m.group(2))]
    return f"{m.group(1)}{layer.layer_number - 1}{m.group(3)}"


def shard(full: torch.Tensor, param, rank: int, size: int) -> torch.Tensor:
    """The TP shard of ``full`` held by ``rank`` (megatron's _initialize_affine_weight_cpu split)."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def unshard(local: torch.Tensor, param, group) -> torch.Tensor:
    """Inverse of :func:`shard`: all-gather the TP shards back to the full tensor."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_rank = [torch.chunk(p, stride, dim=dim) for p in parts]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(size)], dim=dim)


class VOCAB_SHARDED:  # noqa: N801 - stands for a parameter's TP attributes: logits [b, s, V/tp]
    tensor_model_parallel, partition_dim, partition_stride = True, 2, 1


def reference_name(model, name: str) -> str:
    """The world-size-1 name of a sharded parameter. With tied embeddings and PP > 1 the last stage
    holds its own copy of the embedding as ``output_layer.weight``; the reference has only the
    embedding (its output layer has no weight of its own)."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return global_name(model, name)
