"""Exact causal core attention under context parallelism without Transformer Engine (CPU path).

Megatron's load-balanced CP layout splits each sequence of length ``S`` into ``2 * cp`` chunks of
``c = S / (2 cp)`` tokens; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (so causal work is even).
Here every rank all-gathers K and V (``O(S)`` memory per rank: fine for CPU tests, not for long
sequences — on GPU, TE's ring attention is used instead), puts the chunks back in sequence order,
and attends its local queries to all keys with the causal mask written in *global* positions.
The backward of the gather sums the K/V gradients of all ranks' queries (an all-reduce) and keeps
this rank's two chunks, so gradients are exact.

Megatron's ``DotProductAttention`` asserts ``context_parallel_size == 1``; this module takes its
place in the local layer spec (``megatron_credit.models.gpt.gpt_layer_spec``) when CP > 1.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule


def load_balanced_positions(local_len: int, *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions ``[local_len]`` of the tokens rank ``cp_rank`` holds (chunks r, 2cp-1-r).

    >>> load_balanced_positions(4, cp_rank=0, cp_size=2).tolist()
    [0, 1, 6, 7]
    >>> load_balanced_positions(4, cp_rank=1, cp_size=2).tolist()
    [2, 3, 4, 5]
    """
    if local_len % 2:
        raise ValueError(f"local sequence length {local_len} must be even under context parallelism")
    c = local_len // 2
    first = torch.arange(c) + cp_rank * c
    second = torch.arange(c) + (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([first, second])


class _GatherLoadBalanced(torch.autograd.Function):
    """``[2c, ...]`` local chunks -> ``[2 cp c, ...]`` full sequence in order; backward: sum + slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        c = local.shape[0] // 2
        chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp - 1 - r] = part[:c], part[c:]
        ctx.group, ctx.cp, ctx.rank, ctx.c = group, cp, rank, c
        return torch.cat(chunks)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries contributed to every key
        c, r, cp = ctx.c, ctx.rank, ctx.cp
        mine = torch.cat([grad[r * c:(r + 1) * c], grad[(2 * cp - 1 - r) * c:(2 * cp - r) * c]])
        return mine, None


class CpuContextParallelAttention(MegatronModule):
    """Drop-in core attention (``DotProductAttention``'s constructor and forward) for CP > 1.

    ``forward(query [sq, b, np, hn], key [sq, b, ng, hn], value [sq, b, ng, hn], attention_mask)``
    returns ``[sq, b, np * hn]``; ``np``/``ng`` are this TP rank's query heads / KV groups and
    ``sq`` the local (CP-sharded) length. Causal only, no padding mask, no attention dropout.
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
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CPU context-parallel attention supports causal attention only "
                             "(no attention_mask, attention_bias or packed sequences)")
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        sq, b, n_heads, hn = query.shape
        k = _GatherLoadBalanced.apply(key, self.cp_group)  # [S, b, ng, hn]
        v = _GatherLoadBalanced.apply(value, self.cp_group)
        groups = k.shape[2]
        # GQA: query head h uses KV group h // (np / ng), megatron's grouping.
        k = k.repeat_interleave(n_heads // groups, dim=2)
        v = v.repeat_interleave(n_heads // groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        scores = torch.matmul(q.float(), k.permute(1, 2, 3, 0).float()) * self.softmax_scale
        q_pos = load_balanced_positions(sq, cp_rank=rank, cp_size=cp).to(query.device)
        k_pos = torch.arange(k.shape[0], device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)  # [b, np, sq, S]
        out = torch.matmul(probs, v.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * hn)
