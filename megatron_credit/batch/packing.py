"""The packed (THD) form of one micro-batch: its sequences end to end, no padding rows.

A micro-batch of ``n`` sequences of lengths ``L_i`` is one token stream of ``sum(P_i)`` tokens, where
``P_i = round_up(L_i, multiple)`` (``multiple``: ``2 x CP``, ``x TP`` with sequence parallelism; 1
without either). Only that per-sequence alignment is padding; it sits at the end of each sequence, where
causal attention keeps real tokens from reading it. ``cu_seqlens = [0, P_0, P_0 + P_1, ...]`` is megatron's
``PackedSeqParams`` (the padded lengths are the sequence lengths: a real token never attends past its own
sequence's end, so attending to the alignment tokens of its own sequence cannot happen).

Context parallelism (megatron's THD split): each sequence is cut into ``2 x CP`` equal chunks of
``c_i = P_i / (2 CP)`` tokens, and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r`` of every
sequence, in sequence order. This rank's stream is those chunk pairs end to end.

The row view. Per-sequence math (loss aggregations, GSPO's sequence ratio, the Future-KL scan) is written
for rows, one response per row. :meth:`PackedIndex.to_rows` puts this rank's tokens of sequence ``k`` in
row ``k`` of an ``[n, W]`` tensor (differentiably), :meth:`PackedIndex.from_rows` takes them back. Without
CP row ``k`` is the sequence followed by zeros. Under CP it is megatron's load-balanced chunk order: two
halves of ``W / 2 = max_i c_i`` slots, chunk ``r`` at the start of the first and chunk ``2 CP - 1 - r`` at
the start of the second; :attr:`PackedIndex.row_slots` marks which slots hold tokens (a scan must let
its carry pass the empty slots at the end of the first half).

>>> idx = PackedIndex.build([3, 5], multiple=2)
>>> idx.padded_lens, idx.cu_seqlens.tolist(), idx.local_index.tolist()
((4, 6), [0, 4, 10], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
>>> r1 = PackedIndex.build([3, 5], multiple=4, cp_size=2, cp_rank=1)
>>> r1.padded_lens, r1.local_index.tolist()  # chunks 1 and 2 of each sequence (c = 1, then c = 2)
((4, 8), [1, 2, 6, 7, 8, 9])
>>> r1.to_rows(torch.arange(6.0)[None]).tolist()  # W / 2 = 2: chunk 1 then chunk 2 of each row
[[0.0, 0.0, 1.0, 0.0], [2.0, 3.0, 4.0, 5.0]]
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PackedIndex:
    """Where each token of a packed micro-batch lives, on one CP rank (module docstring)."""

    seq_lens: tuple[int, ...]
    """Real tokens of each sequence (prompt + response)."""
    padded_lens: tuple[int, ...]
    """Each sequence's length rounded up to the alignment ``multiple``."""
    cp_size: int
    cp_rank: int
    local_index: torch.Tensor
    """``[t_local]`` int64: the position in the whole packed stream of each of this rank's tokens."""
    seq_ids: torch.Tensor
    """``[t_local]`` int64: the sequence (0..n-1) of each of this rank's tokens."""
    positions: torch.Tensor
    """``[t_local]`` int64: each token's position inside its own sequence (the model's position ids)."""
    row_cols: torch.Tensor
    """``[t_local]`` int64: each token's column in the row view."""

    @classmethod
    def build(cls, seq_lens: Sequence[int], *, multiple: int = 1, cp_size: int = 1, cp_rank: int = 0) -> "PackedIndex":
        """Where each token of sequences of ``seq_lens`` tokens lives; ``multiple`` must be a multiple of
        ``2 x cp_size`` under context parallelism."""
        if cp_size > 1 and multiple % (2 * cp_size):
            raise ValueError(f"the packed alignment {multiple} must be a multiple of 2 x CP = {2 * cp_size}")
        lens = tuple(int(n) for n in seq_lens)
        padded = tuple(_round_up(max(n, 1), multiple) for n in lens)
        half_w = max(padded, default=0) // (2 * cp_size) if cp_size > 1 else 0
        index, seq, pos, col = [], [], [], []
        start = 0
        for k, p in enumerate(padded):
            if cp_size == 1:
                local = torch.arange(p)
                cols = local
            else:
                c = p // (2 * cp_size)
                first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
                second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
                local = torch.cat([first, second])
                cols = torch.cat([torch.arange(c), half_w + torch.arange(c)])
            index.append(start + local)
            pos.append(local)
            col.append(cols)
            seq.append(torch.full((len(local),), k, dtype=torch.long))
            start += p
        cat = lambda xs: torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
        return cls(seq_lens=lens, padded_lens=padded, cp_size=cp_size, cp_rank=cp_rank,
                   local_index=cat(index), seq_ids=cat(seq), positions=cat(pos), row_cols=cat(col))

    # -- sizes ------------------------------------------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole packed stream (all CP ranks), alignment included."""
        return sum(self.padded_lens)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[n + 1]`` int32 offsets of the sequences in the whole stream (megatron's ``cu_seqlens``)."""
        out = torch.zeros(self.num_seqs + 1, dtype=torch.int32)
        out[1:] = torch.tensor(self.padded_lens, dtype=torch.int32).cumsum(0)
        return out

    @property
    def row_width(self) -> int:
        """``W``: columns of the row view (this rank's tokens of the longest sequence, under CP with two
        halves of the same width)."""
        return max(self.padded_lens, default=0) // self.cp_size

    @property
    def row_slots(self) -> torch.Tensor:
        """``[n, W]`` bool: the row-view slots that hold one of this rank's tokens."""
        slots = torch.zeros(self.num_seqs, self.row_width, dtype=torch.bool)
        slots[self.seq_ids, self.row_cols] = True
        return slots

    # -- moving tensors ---------------------------------------------------------------------------------
    def pack(self, rows: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """``rows: [n, T(, ...)]`` (sequence ``k`` in row ``k``, left-aligned) -> this rank's ``[1, t_local(, ...)]``
        stream; positions past a row's end hold ``fill``."""
        width = max(self.padded_lens, default=0)
        if rows.shape[1] < width:
            rows = torch.cat([rows, rows.new_full((rows.shape[0], width - rows.shape[1], *rows.shape[2:]), fill)], 1)
        return rows[self.seq_ids, self.positions].unsqueeze(0)

    def to_rows(self, packed: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """This rank's ``[1, t_local(, ...)]`` -> the row view ``[n, W(, ...)]`` (differentiable; empty slots
        hold ``fill``)."""
        flat = packed.squeeze(0)
        out = flat.new_full((self.num_seqs, self.row_width, *flat.shape[1:]), fill)
        seq, col = self.seq_ids.to(flat.device), self.row_cols.to(flat.device)
        return out.index_put((seq, col), flat)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The row view ``[n, W(, ...)]`` -> this rank's ``[1, t_local(, ...)]`` (differentiable)."""
        return rows[self.seq_ids.to(rows.device), self.row_cols.to(rows.device)].unsqueeze(0)

    def whole_rows(self, packed: torch.Tensor, *, cp_group: Optional[Any] = None, fill: Any = 0) -> torch.Tensor:
        """This rank's ``[1, t_local]`` -> every sequence whole, ``[n, max(P_i)]`` (gathered over ``cp_group``
        under CP; not differentiable). The inverse of :meth:`pack` on the tokens."""
        flat = packed.squeeze(0)
        full = flat.new_full((self.total_tokens, *flat.shape[1:]), fill)
        if self.cp_size > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(flat) for _ in range(self.cp_size)]
            dist.all_gather(parts, flat.contiguous(), group=cp_group)
            for r, part in enumerate(parts):
                full[_rank_index(self, r).to(flat.device)] = part
        else:
            full[self.local_index.to(flat.device)] = flat
        out = flat.new_full((self.num_seqs, max(self.padded_lens, default=0), *flat.shape[1:]), fill)
        starts = self.cu_seqlens.tolist()
        for k, p in enumerate(self.padded_lens):
            out[k, :p] = full[starts[k]:starts[k] + p]
        return out


def _rank_index(index: PackedIndex, rank: int) -> torch.Tensor:
    """``local_index`` of CP rank ``rank`` of the same sequences."""
    if rank == index.cp_rank:
        return index.local_index
    multiple = 2 * index.cp_size
    other = PackedIndex.build(index.padded_lens, multiple=multiple, cp_size=index.cp_size, cp_rank=rank)
    return other.local_index


def rank_indices(cu_seqlens: Sequence[int], *, cp_size: int) -> list[torch.Tensor]:
    """``local_index`` of every CP rank for sequences at ``cu_seqlens`` (padded to ``2 x cp_size``): where each
    rank's tokens sit in the whole stream (the CPU attention's gather).

    >>> [t.tolist() for t in rank_indices([0, 4, 8], cp_size=2)]
    [[0, 3, 4, 7], [1, 2, 5, 6]]
    """
    lens = [int(b) - int(a) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    multiple = 2 * cp_size if cp_size > 1 else 1
    return [PackedIndex.build(lens, multiple=multiple, cp_size=cp_size, cp_rank=r).local_index
            for r in range(cp_size)]


def host_cu_seqlens(params) -> list[int]:
    """The (padded) ``cu_seqlens`` of megatron's ``PackedSeqParams`` as host ints: the copy the trainer's
    micro-batch attaches (``cu_seqlens_host``), else read from the tensor (a device sync on GPU)."""
    host = getattr(params, "cu_seqlens_host", None)
    if host is not None:
        return list(host)
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return [int(x) for x in cu.tolist()]
