"""Typed tensor transforms between Hugging Face and megatron-core tensor shapes, and their TP splits.

Every transform is a pair of pure functions (HF -> megatron and back) over full, unsharded tensors,
and every one asserts that no element is lost: the output holds exactly the input's elements.

Fused QKV. megatron's ``linear_qkv`` keeps the rows of one query group together so that a TP rank owns
whole groups: for group ``g`` (of ``G = num_query_groups``) the rows are
``[q heads g*h .. (g+1)*h - 1 ; k head g ; v head g]`` with ``h = num_heads // G`` heads per group,
each head ``head_dim`` rows. HF keeps ``q_proj`` ([n_heads * d, hidden]), ``k_proj`` and ``v_proj``
([G * d, hidden]) apart. Biases ([rows]) follow the same row order. Under TP, ``linear_qkv`` is split in
contiguous row blocks (``TPSplit.ROWS``): whole groups per rank when TP divides G; when TP is a multiple
of G (TP > KV heads, e.g. 2 KV heads at TP = 4) a block is part of a group, and megatron-core's attention
all-gathers the fused output and keeps the rank's group (``Attention.get_query_key_value_tensors``), so
the stored row order -- and every transform here -- is the same as for TP <= G.

Gated MLP. megatron's ``linear_fc1`` is ``[gate; up]`` ([2 * ffn, hidden]); under TP each rank holds
``[gate_r; up_r]``, so a TP shard of fc1 is *not* a contiguous row block of the full tensor.

>>> import torch
>>> q, k, v = torch.arange(8.).view(4, 2), torch.arange(8., 12.).view(2, 2), torch.arange(12., 16.).view(2, 2)
>>> qkv = fuse_qkv(q, k, v, num_heads=4, num_query_groups=2, head_dim=1)
>>> qkv[:, 0].tolist()   # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
[0.0, 2.0, 8.0, 12.0, 4.0, 6.0, 10.0, 14.0]
>>> all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, num_heads=4, num_query_groups=2, head_dim=1), (q, k, v)))
True
"""
from __future__ import annotations

import torch

from megatron_credit.families.base import TPSplit  # noqa: F401 - the splits the transforms shard by


def _check_numel(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    n_in, n_out = sum(t.numel() for t in inputs), sum(t.numel() for t in outputs)
    assert n_in == n_out, f"{name}: {n_in} elements in, {n_out} out"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int,
             num_query_groups: int, head_dim: int, name: str = "linear_qkv") -> torch.Tensor:
    """HF ``q`` [H*d, ...], ``k``/``v`` [G*d, ...] -> megatron ``linear_qkv`` [(H + 2G)*d, ...].

    Works for weights ([rows, hidden]) and biases ([rows]): only dim 0 is rearranged. ``name`` (the
    tensor being converted) is quoted in errors.
    """
    if num_heads % num_query_groups:
        raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    h, g, d = num_heads // num_query_groups, num_query_groups, head_dim
    if q.shape[0] != num_heads * d or k.shape[0] != g * d or v.shape[0] != g * d:
        raise ValueError(f"{name}: q/k/v rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]} do not match "
                         f"heads={num_heads}, groups={g}, head_dim={d}")
    rest = q.shape[1:]
    out = torch.cat([q.reshape(g, h * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    out = out.reshape((h + 2) * g * d, *rest)
    _check_numel("fuse_qkv", [q, k, v], [out])
    return out


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_query_groups: int,
              head_dim: int, name: str = "linear_qkv") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: megatron ``linear_qkv`` [(H + 2G)*d, ...] -> HF (q, k, v)."""
    if num_heads % num_query_groups:
        raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of num_query_groups={num_query_groups}")
    h, g, d = num_heads // num_query_groups, num_query_groups, head_dim
    if qkv.shape[0] != (h + 2) * g * d:
        raise ValueError(f"{name} has {qkv.shape[0]} rows, expected (H + 2G) * d = {(h + 2) * g * d}")
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (h + 2) * d, *rest)
    q, k, v = torch.split(grouped, [h * d, d, d], dim=1)
    q, k, v = (t.reshape(-1, *rest).contiguous() for t in (q, k, v))
    _check_numel("split_qkv", [qkv], [q, k, v])
    return q, k, v


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj``, ``up_proj`` [ffn, ...] -> megatron ``linear_fc1`` [2*ffn, ...] = [gate; up]."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    out = torch.cat([gate, up], dim=0)
    _check_numel("fuse_gate_up", [gate, up], [out])
    return out


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    if fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 has an odd number of rows ({fc1.shape[0]})")
    gate, up = (t.contiguous() for t in torch.chunk(fc1, 2, dim=0))
    _check_numel("split_gate_up", [fc1], [gate, up])
    return gate, up


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 to ``rows`` (megatron pads the vocabulary to a multiple of 128 * TP)."""
    if rows < t.shape[0]:
        raise ValueError(f"cannot pad {t.shape[0]} rows down to {rows}")
    if rows == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def tp_shard(full: torch.Tensor, split: TPSplit, *, rank: int, size: int) -> torch.Tensor:
    """The part of the full megatron tensor that TP rank ``rank`` of ``size`` holds."""
    if split is TPSplit.REPLICATED or size == 1:
        return full
    dim = 1 if split is TPSplit.COLS else 0
    if full.shape[dim] % (2 * size if split is TPSplit.GATED_ROWS else size):
        raise ValueError(f"dim {dim} of size {full.shape[dim]} does not split over TP={size} ({split.value})")
    if split is TPSplit.GATED_ROWS:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def tp_gather(shards: list[torch.Tensor], split: TPSplit) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the TP shards of ranks 0..size-1 -> the full tensor."""
    if split is TPSplit.REPLICATED or len(shards) == 1:
        return shards[0]
    if split is TPSplit.COLS:
        return torch.cat(shards, dim=1)
    if split is TPSplit.ROWS:
        return torch.cat(shards, dim=0)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
