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

from megatron_credit.cp_layout import load_balanced_positions, merge_cp_shards, split_for_cp  # noqa: F401


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
