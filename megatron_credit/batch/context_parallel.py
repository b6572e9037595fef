"""Splitting a batch along the sequence for context parallelism (CP), and gathering it back.

Megatron's load-balanced chunk order (rank ``r`` keeps chunks ``r`` and ``2*cp - 1 - r`` of ``2 * cp``) is
defined once, in ``megatron_credit/batch/cp_chunks.py``; ``split_for_cp`` and ``merge_cp_shards`` come from there.

Labels are shifted *before* the split (``shift_labels``): the label of the last token of a chunk is the
first token of the next chunk, which another rank holds. Per-token results (log-probs, entropies,
advantages) are gathered back into sequence order with ``gather_from_cp``.

>>> x = torch.arange(8).view(1, 8)
>>> [split_for_cp(x, cp_size=2, cp_rank=r).tolist() for r in range(2)]
[[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
>>> merge_cp_shards([split_for_cp(x, cp_size=2, cp_rank=r) for r in range(2)]).tolist()
[[0, 1, 2, 3, 4, 5, 6, 7]]
>>> shift_labels(torch.tensor([[5, 6, 7]]), pad_id=0).tolist()
[[6, 7, 0]]
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_credit.batch.cp_chunks import check_sequence_length, merge_cp_shards, split_for_cp

__all__ = [
    "shift_labels", "split_for_cp", "merge_cp_shards", "gather_from_cp", "required_multiple",
    "check_sequence_length", "pad_for_parallel",
]


def shift_labels(input_ids: torch.Tensor, *, pad_id: int) -> torch.Tensor:
    """``labels[:, t] = input_ids[:, t+1]``; the last position gets ``pad_id``.

    ``input_ids: [B, T]`` -> ``labels: [B, T]``. In packed sequences the last token of each sequence gets
    the first token of the next one as its label: the loss mask must exclude it.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    pad = torch.full_like(input_ids[:, :1], pad_id)
    return torch.cat([input_ids[:, 1:], pad], dim=1)


def required_multiple(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """The sequence length must be a multiple of this: ``2*cp*tp`` with sequence parallelism, else ``2*cp``.

    ``2*cp`` equal chunks for the load-balanced CP chunk order; with sequence parallelism each rank's
    ``T / cp`` tokens are further split over ``tp``.

    >>> required_multiple(2, 4, True), required_multiple(2, 4, False)
    (16, 4)
    """
    if cp_size < 1 or tp_size < 1:
        raise ValueError(f"cp_size and tp_size must be >= 1, got cp_size={cp_size}, tp_size={tp_size}")
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def pad_for_parallel(x: torch.Tensor, *, multiple: int, value, seq_dim: int = 1) -> torch.Tensor:
    """Right-pad ``x`` along ``seq_dim`` with ``value`` to the next multiple of ``multiple`` (at least one).

    >>> pad_for_parallel(torch.tensor([[1, 2, 3]]), multiple=4, value=0).tolist()
    [[1, 2, 3, 0]]
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    seq_len = x.shape[seq_dim]
    target = max(multiple, -(-seq_len // multiple) * multiple)
    if target == seq_len:
        return x
    shape = list(x.shape)
    shape[seq_dim] = target - seq_len
    return torch.cat([x, x.new_full(shape, value)], dim=seq_dim)


class _GatherFromCP(torch.autograd.Function):
    """All-gather the CP shards and undo the chunk order; backward returns this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, local, group, seq_dim):
        size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local, group=group)
        ctx.size, ctx.rank, ctx.seq_dim = size, rank, seq_dim
        return merge_cp_shards(shards, seq_dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return split_for_cp(grad, cp_size=ctx.size, cp_rank=ctx.rank, seq_dim=ctx.seq_dim), None, None


def gather_from_cp(local: torch.Tensor, *, cp_group, seq_dim: int = 1) -> torch.Tensor:
    """All-gather ``local`` (this rank's ``split_for_cp`` part) over ``cp_group`` -> the full sequence.

    ``cp_group=None`` (or a group of size 1) returns ``local``. Autograd: like megatron's
    ``gather_from_tensor_model_parallel_region``, the backward returns this rank's slice of the incoming
    gradient without a reduction, which is right when every CP rank computes the same function of the
    gathered tensor (replicated computation). If each rank instead computes a different partial loss,
    the caller must sum the gradients over the group.
    """
    if cp_group is None or dist.get_world_size(group=cp_group) == 1:
        return local
    return _GatherFromCP.apply(local, cp_group, seq_dim)
