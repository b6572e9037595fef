"""Exact causal core attention without Transformer Engine (CPU path), under context parallelism and for
packed (THD) micro-batches.

Megatron's load-balanced CP chunk order splits each sequence of length ``S`` into ``2 * cp`` chunks of
``c = S / (2 cp)`` tokens; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (so causal work is even).
Here every rank all-gathers K and V (``O(S)`` memory per rank: fine for CPU tests, not for long
sequences — on GPU, TE's ring attention is used instead), puts the chunks back in sequence order,
and attends its local queries to all keys with the causal mask written in *global* positions.
The backward of the gather sums the K/V gradients of all ranks' queries (an all-reduce) and keeps
this rank's two chunks, so gradients are exact.

Packed sequences (``packed_seq_params`` in THD format, ``batch/packing.py``): the micro-batch is one
token stream ``[t, heads, dim]`` of sequences at ``cu_seqlens``; each sequence attends causally to its own
tokens only, one sequence at a time (no ``[t, t]`` score matrix across sequences). Under CP each rank holds
two chunks of every sequence (megatron's THD split); K and V are gathered into stream order as above.

Megatron's ``DotProductAttention`` asserts ``context_parallel_size == 1`` and no packed sequences; this
module takes its place in the local layer spec (``megatron_credit.models.gpt.gpt_layer_spec``) when
CP > 1 or when the trainer packs sequences.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from megatron_credit.batch.cp_chunks import load_balanced_positions, merge_cp_shards, split_for_cp  # noqa: F401
from megatron_credit.batch.packing import PackedIndex, host_cu_seqlens, rank_indices


class _GatherLoadBalanced(torch.autograd.Function):
    """``[2c, ...]`` local chunks -> ``[2 cp c, ...]`` full sequence in order; backward: sum + slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.cp, ctx.rank = group, cp, rank
        return merge_cp_shards(parts, seq_dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries contributed to every key
        return split_for_cp(grad, cp_size=ctx.cp, cp_rank=ctx.rank, seq_dim=0), None


class _GatherPacked(torch.autograd.Function):
    """This rank's ``[t_local, ...]`` share of a packed stream -> the whole stream ``[t, ...]`` in order;
    backward: sum over ranks, keep this rank's tokens."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, indices) -> torch.Tensor:
        rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in indices]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = local.new_empty((sum(len(i) for i in indices), *local.shape[1:]))
        for idx, part in zip(indices, parts):
            full[idx.to(local.device)] = part
        ctx.group, ctx.own = group, indices[rank]
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.own.to(grad.device)], None, None


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [b, np, sq, hn]`` against ``k, v [b, np, S, hn]`` with key ``j`` visible to query ``i`` when
    ``j <= q_pos[i]``; ``[b, np, sq, hn]``."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float()) * scale
    k_pos = torch.arange(k.shape[-2], device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class CpuContextParallelAttention(MegatronModule):
    """Drop-in core attention (``DotProductAttention``'s constructor and forward) for CP > 1 and for packed
    sequences.

    ``forward(query [sq, b, np, hn], key [sq, b, ng, hn], value [sq, b, ng, hn], attention_mask)``
    returns ``[sq, b, np * hn]``; ``np``/``ng`` are this TP rank's query heads / KV groups and
    ``sq`` the local (CP-sharded) length. With ``packed_seq_params`` (THD) the inputs are ``[t, np, hn]``
    and the output ``[t, np * hn]``. Causal only, no padding mask, no attention dropout.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        from megatron.core import parallel_state

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("CPU context-parallel attention has no attention dropout; set "
                             "attention_dropout=0")
        if pg_collection is not None and hasattr(pg_collection, "cp"):
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = parallel_state.get_context_parallel_group()
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.attn_mask_type = attn_mask_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("CPU context-parallel attention supports causal attention only "
                             "(no attention_mask or attention_bias)")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        sq, b, n_heads, hn = query.shape
        if cp > 1:
            k = _GatherLoadBalanced.apply(key, self.cp_group)  # [S, b, ng, hn]
            v = _GatherLoadBalanced.apply(value, self.cp_group)
        else:  # a packing model's padded batches (the supervised warm-up)
            k, v = key, value
        groups = k.shape[2]
        # GQA: query head h uses KV group h // (np / ng), megatron's grouping.
        k = k.repeat_interleave(n_heads // groups, dim=2)
        v = v.repeat_interleave(n_heads // groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        scores = torch.matmul(q.float(), k.permute(1, 2, 3, 0).float()) * self.softmax_scale
        q_pos = (load_balanced_positions(sq, cp_rank=rank, cp_size=cp) if cp > 1 else torch.arange(sq)).to(query.device)
        k_pos = torch.arange(k.shape[0], device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [b, np, sq, S]
        out = torch.matmul(probs, v.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * hn)

    def _packed(self, query, key, value, params):
        """THD: ``query [t, np, hn]``, ``key, value [t, ng, hn]`` (this CP rank's chunks of every sequence at
        ``cu_seqlens``) -> ``[t, np * hn]``. Sequences of similar lengths are attended as one padded batch
        (:func:`length_groups`), each query against its own sequence's keys only."""
        if params.qkv_format != "thd":
            raise ValueError(f"CPU attention: packed sequences in format {params.qkv_format!r}; expected 'thd'")
        cu = host_cu_seqlens(params)
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        rank = dist.get_rank(self.cp_group) if cp > 1 else 0
        if cp > 1:  # every sequence's keys and values whole, in stream order
            indices = _rank_indices(tuple(cu), cp)
            key = _GatherPacked.apply(key, self.cp_group, indices)
            value = _GatherPacked.apply(value, self.cp_group, indices)
        t, n_heads, hn = query.shape
        rep = n_heads // key.shape[1]  # GQA: query head h uses KV group h // (np / ng)
        out = query.new_zeros((t, n_heads * hn))
        for q_idx, dst, src, k_idx, q_pos in _group_indices(tuple(cu), cp, rank, query.device):
            g, mq = q_idx.shape
            q = query[q_idx].permute(0, 2, 1, 3)  # [g, np, mq, hn]
            k = key[k_idx].repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)  # [g, np, mk, hn]
            v = value[k_idx].repeat_interleave(rep, dim=2).permute(0, 2, 1, 3)
            scores = torch.matmul(q.float(), k.transpose(-1, -2).float()) * self.softmax_scale
            hidden = torch.arange(k_idx.shape[1], device=q.device)[None, None, :] > q_pos[:, :, None]  # [g, mq, mk]
            probs = torch.softmax(scores.masked_fill(hidden[:, None], float("-inf")), dim=-1).to(value.dtype)
            o = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(g, mq, n_heads * hn)
            out = out.index_put((dst,), o.reshape(g * mq, -1)[src])  # integer indices: no host read
        return out


@functools.lru_cache(maxsize=8)  # every layer of a micro-batch's forward and backward reads the same
def _rank_indices(cu: tuple[int, ...], cp: int) -> list[torch.Tensor]:
    return rank_indices(list(cu), cp_size=cp)


@functools.lru_cache(maxsize=8)
def _group_indices(cu: tuple[int, ...], cp: int, rank: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per :func:`length_groups` group of the sequences at ``cu`` (this CP rank's queries), all of one bucket
    length ``L``: ``q_idx [g, L / cp]`` local stream indices of the queries (padding slots repeat the
    sequence's last one), ``dst`` the local stream indices of the real (not padding) query slots and ``src``
    those slots' flat indices in ``[g * L / cp]`` (found here, on the host: a boolean index on the device would
    read it back every layer), ``k_idx [g, L]`` whole-stream indices of the keys (past a sequence's end its
    last key, never visible: causal) and ``q_pos [g, L / cp]`` the queries' positions in their sequence (0 in
    padding slots)."""
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    index = PackedIndex.build(lens, multiple=2 * cp if cp > 1 else 1, cp_size=cp, cp_rank=rank)
    local_start = [0]
    for n in lens:
        local_start.append(local_start[-1] + n // cp)
    out = []
    for bucket, group in length_groups(lens, multiple=2 * cp if cp > 1 else 1):
        mq = bucket // cp
        q_idx = torch.stack([torch.arange(local_start[k], local_start[k] + mq).clamp(max=local_start[k + 1] - 1)
                             for k in group])
        valid = torch.stack([torch.arange(mq) < lens[k] // cp for k in group])
        k_idx = torch.stack([torch.arange(cu[k], cu[k] + bucket).clamp(max=cu[k + 1] - 1) for k in group])
        q_pos = torch.where(valid, index.positions[q_idx], 0)
        dst, src = q_idx[valid], valid.flatten().nonzero().squeeze(1)
        out.append(tuple(x.to(device) for x in (q_idx, dst, src, k_idx, q_pos)))
    return out


def bucket_length(n: int, *, multiple: int = 1) -> int:
    """``n`` rounded up to one of four steps per octave (less than a quarter more: 17 -> 20, 1025 -> 1280), and to
    a multiple of ``multiple``; at least 16.

    >>> [bucket_length(n) for n in (3, 16, 17, 100, 1000, 1025)], bucket_length(17, multiple=8)
    ([16, 16, 20, 112, 1024, 1280], 24)
    """
    n = max(n, 16)
    step = 1 << max(n.bit_length() - 3, 0)
    n = -(-n // step) * step
    return -(-n // multiple) * multiple


def length_groups(lens: list[int], *, multiple: int = 1, max_scores: int = 1 << 23) -> list[tuple[int, list[int]]]:
    """Sequences (indices into ``lens``) to attend as one padded batch each, ``(bucket length, indices)``,
    longest first: those of one :func:`bucket_length`, as many at a time as keep ``count x bucket**2`` (the
    score matrix of one head) within ``max_scores``. Each sequence's padded length depends on its own
    length only, so its attention is computed the same way whatever other sequences share its micro-batch.

    >>> length_groups([10, 40, 3, 37, 200])
    [(224, [4]), (40, [1, 3]), (16, [0, 2])]
    """
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        buckets.setdefault(bucket_length(n, multiple=multiple), []).append(i)
    out = []
    for b in sorted(buckets, reverse=True):
        per = max(max_scores // (b * b), 1)
        out += [(b, buckets[b][s:s + per]) for s in range(0, len(buckets[b]), per)]
    return out
