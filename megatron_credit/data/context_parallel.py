"""Splitting a batch along the sequence for context parallelism (CP), and gathering it back.

Megatron's load-balanced layout (``megatron.core.utils.get_batch_on_this_cp_rank``): with causal
attention the last tokens of a sequence attend to the most keys, so the sequence is cut into ``2 * cp``
equal chunks and rank ``r`` keeps chunks ``r`` and ``2*cp - 1 - r`` (concatenated in that order). Every
rank then holds one cheap and one expensive chunk.

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

from typing import Optional, Sequence

import torch
import torch.distributed as dist

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

    ``2*cp`` equal chunks for the load-balanced CP layout; with sequence parallelism each rank's
    ``T / cp`` tokens are further split over ``tp``.

    >>> required_multiple(2, 4, True), required_multiple(2, 4, False)
    (16, 4)
    """
    if cp_size < 1 or tp_size < 1:
        raise ValueError(f"cp_size and tp_size must be >= 1, got cp_size={cp_size}, tp_size={tp_size}")
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def check_sequence_length(seq_len: int, *, multiple: int) -> None:
    """Raise a ``ValueError`` naming ``seq_len`` unless it is a positive multiple of ``multiple``."""
    if seq_len < multiple or seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} is {'shorter than' if seq_len < multiple else 'not divisible by'} "
            f"{multiple} (= 2*cp[*tp with sequence parallelism], see required_multiple); pad it with "
            f"pad_for_parallel or enable padding")


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


def split_for_cp(x: torch.Tensor, *, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` in megatron's load-balanced layout: chunks ``r`` and ``2*cp-1-r`` of 2*cp.

    ``x: [..., T, ...]`` (T at ``seq_dim``) -> ``[..., 2*T/(2*cp), ...]``. Differentiable (slices and a
    concatenation). Raises ``ValueError`` naming the length when ``T`` is not a multiple of ``2*cp``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if cp_size == 1:
        return x
    check_sequence_length(x.shape[seq_dim], multiple=2 * cp_size)
    chunk = x.shape[seq_dim] // (2 * cp_size)
    return torch.cat([x.narrow(seq_dim, cp_rank * chunk, chunk),
                      x.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)], dim=seq_dim)


def merge_cp_shards(shards: Sequence[torch.Tensor], *, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``split_for_cp``: the ``cp`` shards in rank order -> the full sequence."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    local = shards[0].shape[seq_dim]
    if local % 2 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"CP shards must have equal shapes with an even sequence length, got "
                         f"{[tuple(s.shape) for s in shards]}")
    half = local // 2
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for r, s in enumerate(shards):
        chunks[r] = s.narrow(seq_dim, 0, half)
        chunks[2 * cp_size - 1 - r] = s.narrow(seq_dim, half, half)
    return torch.cat(chunks, dim=seq_dim)


class _GatherFromCP(torch.autograd.Function):
    """All-gather the CP shards and undo the layout; backward returns this rank's slice of the gradient."""

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
