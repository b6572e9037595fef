"""Megatron's load-balanced context-parallel chunk order, the one definition every CP-aware module uses.

With causal attention the last tokens of a sequence attend to the most keys, so megatron
(``megatron.core.utils.get_batch_on_this_cp_rank``) cuts each sequence into ``2 * cp`` equal chunks and
rank ``r`` keeps chunks ``r`` and ``2*cp - 1 - r``, concatenated in that order: every rank holds one cheap
and one expensive chunk. Torch only (no process group here): the batch split (``data/context_parallel``),
the CPU CP attention and the final-layer capture (``models/``) and the CP scan (``credit/scan``) all read
the chunk order from these functions.

>>> rank_chunks(cp_rank=0, cp_size=2), chunk_owner(3, cp_size=2)
((0, 3), (0, 1))
>>> x = torch.arange(8).view(1, 8)
>>> [split_for_cp(x, cp_size=2, cp_rank=r).tolist() for r in range(2)]
[[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
>>> merge_cp_shards([split_for_cp(x, cp_size=2, cp_rank=r) for r in range(2)]).tolist()
[[0, 1, 2, 3, 4, 5, 6, 7]]
>>> load_balanced_positions(4, cp_rank=1, cp_size=2).tolist()
[2, 3, 4, 5]
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def rank_chunks(*, cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that rank ``cp_rank`` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def chunk_owner(j: int, *, cp_size: int) -> tuple[int, int]:
    """``(rank, half)`` holding global chunk ``j``: half 0 is the rank's first local chunk, 1 its second."""
    return (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)


def split_for_cp(x: torch.Tensor, *, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` in megatron's load-balanced chunk order: chunks ``r`` and ``2*cp-1-r`` of 2*cp.

    ``x: [..., T, ...]`` (T at ``seq_dim``) -> ``[..., 2*T/(2*cp), ...]``. Differentiable (slices and a
    concatenation). Raises ``ValueError`` naming the length when ``T`` is not a multiple of ``2*cp``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if cp_size == 1:
        return x
    check_sequence_length(x.shape[seq_dim], multiple=2 * cp_size)
    chunk = x.shape[seq_dim] // (2 * cp_size)
    first, second = rank_chunks(cp_rank=cp_rank, cp_size=cp_size)
    return torch.cat([x.narrow(seq_dim, first * chunk, chunk),
                      x.narrow(seq_dim, second * chunk, chunk)], dim=seq_dim)


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
        first, second = rank_chunks(cp_rank=r, cp_size=cp_size)
        chunks[first] = s.narrow(seq_dim, 0, half)
        chunks[second] = s.narrow(seq_dim, half, half)
    return torch.cat(chunks, dim=seq_dim)


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
    first, second = rank_chunks(cp_rank=cp_rank, cp_size=cp_size)
    return torch.cat([torch.arange(c) + first * c, torch.arange(c) + second * c])


def check_sequence_length(seq_len: int, *, multiple: int) -> None:
    """Raise a ``ValueError`` naming ``seq_len`` unless it is a positive multiple of ``multiple``."""
    if seq_len < multiple or seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} is {'shorter than' if seq_len < multiple else 'not divisible by'} "
            f"{multiple} (= 2*cp[*tp with sequence parallelism], see required_multiple); pad it with "
            f"pad_for_parallel or enable padding")
