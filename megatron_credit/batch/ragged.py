"""A mixture of experts' routing as the rollout engine reported it, one row per sample, no padding, until the
micro-batch that replays it (:class:`RaggedRouting`).

Each sample's ``routed_experts`` is ``[num_tokens, layers, top_k]`` int16 (``RolloutSample``). Padded to the
batch's longest sample, a trainer rank's share would be ``[samples, longest, layers, top_k]``: with
``examples/fipo_qwen3_30b_a3b.yaml`` (1,024 samples per DP rank of up to 22,528 tokens, 48 layers, top-8)
17.7 GB of host memory every iteration, for routing that the actor replays one micro-batch at a time. So
the batch keeps the samples' own tensors (``TrainBatch.routed_experts``; host memory, no copy), and each
micro-batch gathers its rows' routing, already cut, padded, packed and CP-split, right before it goes to
the actor's device (``batch/train_batch.py``): the padded routing alive on the host is one micro-batch's
(two while its pinned copy is made), whatever the batch.

What a micro-batch gets is what cutting the padded ``[B, T, layers, top_k]`` tensor (-1 past each row's end
and on rows without routing) would give, bit for bit (``tests/trainer/test_ragged_routing.py``):
:meth:`RaggedRouting.block` the padded rows ``[b, s]`` (under CP this rank's load-balanced positions),
:meth:`RaggedRouting.stream` a packed stream ``[1, t]``.

>>> r = RaggedRouting.of([torch.arange(6, dtype=torch.int16).view(3, 1, 2), None])
>>> r.padded(4)[:, :, 0].tolist()
[[[0, 1], [2, 3], [4, 5], [-1, -1]], [[-1, -1], [-1, -1], [-1, -1], [-1, -1]]]
>>> r.block([1, 0], positions=torch.tensor([0, 2, 3]), num_rows=3)[:, :, 0, 0].tolist()
[[-1, -1, -1], [0, 4, -1], [-1, -1, -1]]
>>> r.stream([0, 1], seq_ids=torch.tensor([0, 0, 1]), positions=torch.tensor([2, 0, 0]))[0, :, 0, 1].tolist()
[5, 1, -1]
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

FILL = -1
"""A token without routing: past a row's end, a row the engine reported none for, padding."""


@dataclasses.dataclass(frozen=True, eq=False)  # rows of tensors: identity, not ==
class RaggedRouting:
    """Each row's routing ``[n_i, layers, top_k]`` int16 on the host (None: none reported), in the batch's row
    order (module docstring)."""

    rows: tuple[Optional[torch.Tensor], ...]
    layers: int
    top_k: int

    @classmethod
    def of(cls, routes: Sequence[Optional[torch.Tensor]]) -> Optional["RaggedRouting"]:
        """The rows' routing (a sample's ``routed_experts`` each, or None); None when no row has any. Int16
        host tensors are kept as they are (not copied); all rows must have one ``[layers, top_k]``."""
        shapes = sorted({tuple(r.shape[1:]) for r in routes if r is not None})
        if not shapes:
            return None
        if len(shapes) > 1:
            raise ValueError(f"samples report routing of different [layers, top_k] shapes: {shapes}")
        layers, top_k = shapes[0]
        rows = tuple(None if r is None else r.to("cpu", torch.int16) for r in routes)
        return cls(rows=rows, layers=int(layers), top_k=int(top_k))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (what the engine reported, no padding)."""
        return sum(r.numel() * r.element_size() for r in self.rows if r is not None)

    def stream(self, rows: Sequence[int], *, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[1, t, layers, top_k]``: token ``j`` is the routing of row ``rows[seq_ids[j]]`` at its position
        ``positions[j]``; -1 past the row's end, on a row without routing and where ``seq_ids[j] >= len(rows)``
        (a padding row). A packed micro-batch's stream is ``PackedIndex``'s ``seq_ids`` and ``positions``."""
        out = torch.full((len(seq_ids), self.layers, self.top_k), FILL, dtype=torch.int16)
        if len(seq_ids):
            order = torch.argsort(seq_ids, stable=True)  # the tokens of each row, together
            counts = torch.bincount(seq_ids, minlength=len(rows)).tolist()
            for row, at in zip(rows, order.split(counts)):
                r = self.rows[row]
                if r is not None:
                    _copy_runs(out, at, r, positions[at])
        return out.unsqueeze(0)

    def block(self, rows: Sequence[int], *, positions: torch.Tensor, num_rows: int) -> torch.Tensor:
        """``[num_rows, len(positions), layers, top_k]``: row ``i`` is the routing of row ``rows[i]`` at the
        (global) ``positions`` (``arange(seq_len)``, or a CP rank's load-balanced positions); rows past
        ``len(rows)`` are padding (-1), as is every position past a row's end."""
        n = len(positions)
        out = torch.full((num_rows, n, self.layers, self.top_k), FILL, dtype=torch.int16)
        slots = torch.arange(n)
        for i, row in enumerate(rows):
            r = self.rows[row]
            if r is not None:
                _copy_runs(out[i], slots, r, positions)
        return out

    def padded(self, width: Optional[int] = None) -> torch.Tensor:
        """The whole ``[B, width, layers, top_k]`` padded form (``width``: the longest row by default). For
        tests and inspection: the trainer never makes it."""
        longest = max((r.shape[0] for r in self.rows if r is not None), default=0)
        width = longest if width is None else width
        return self.block(range(len(self.rows)), positions=torch.arange(width), num_rows=len(self.rows))


def _copy_runs(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """``dst[dst_index[j]] = src[src_index[j]]`` for every ``j`` with ``src_index[j] < len(src)``, one slice
    copy per run of consecutive indices on both sides (a row, a CP rank's two chunks of it): no gathered
    temporary of the routing."""
    keep = src_index < src.shape[0]
    d, s = dst_index[keep], src_index[keep]
    if not len(d):
        return
    breaks = ((d[1:] - d[:-1] != 1) | (s[1:] - s[:-1] != 1)).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(d)]
    for a, b, d0, s0 in zip(bounds[:-1], bounds[1:], d[bounds[:-1]].tolist(), s[bounds[:-1]].tolist()):
        dst[d0:d0 + b - a] = src[s0:s0 + b - a]
