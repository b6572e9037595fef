"""A mini-batch's rows into micro-batches, and the micro-batches' outputs back into the batch's rows.

:meth:`MicroBatchCut.cut` cuts the micro-batches a forward pass reads from one mini-batch's plan
(``microbatch.py``); :class:`RowCopies` writes per-token outputs of those micro-batches (this rank's
tokens, or whole rows) back into the batch's host tensors, one device-to-host copy per target tensor.
Both are shared by the behaviour pass and the update (``trainer/step.py``, docs/architecture.md
"Data flow"); how to cut (packing, CP rank, one shape under PP) is passed in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_credit.batch.train_batch import MicroBatch, TrainBatch, make_microbatch, make_packed_microbatch, round_up


@dataclasses.dataclass(frozen=True)
class MicroBatchCut:
    """How a mini-batch's rows become micro-batches: packed streams (each sequence aligned to
    ``multiple``; under PP megatron sends each one's own shape), or rows padded to ``multiple`` (and to one
    shape with ``one_shape``, under PP: megatron's pipeline then communicates one fixed shape per call);
    on ``device``, this CP rank's share (``cp_size``, ``cp_rank``)."""

    packed: bool
    multiple: int
    pad_id: int
    device: Any
    cp_size: int = 1
    cp_rank: int = 0
    one_shape: bool = False

    def cut(self, batch: TrainBatch, mini: list[list[int]]) -> list[MicroBatch]:
        """The micro-batches of one mini-batch (``mini``: the row indices of each, ``microbatch.py``'s plan)."""
        if self.packed:
            return [make_packed_microbatch(batch, mb, multiple=self.multiple, pad_id=self.pad_id, device=self.device,
                                           cp_size=self.cp_size, cp_rank=self.cp_rank) for mb in mini]
        lens = [round_up(int(max(batch.seq_lens[mb])), self.multiple) for mb in mini]
        if self.one_shape:
            rows, lens = [max(len(mb) for mb in mini)] * len(mini), [max(lens)] * len(mini)
        else:
            rows = [len(mb) for mb in mini]
        return [make_microbatch(batch, mb, seq_len=s, num_rows=r, pad_id=self.pad_id, device=self.device,
                                cp_size=self.cp_size, cp_rank=self.cp_rank) for mb, s, r in zip(mini, lens, rows)]


class RowCopies:
    """Micro-batch outputs bound for the batch's host tensors, copied there together by :meth:`flush`: one
    device-to-host copy per target tensor, not one per micro-batch (each copy makes the host wait for the
    device, and the host then has no kernels queued for the next micro-batch). The outputs stay on the
    device until then: per-token tensors of this rank's rows, small beside the model's activations.
    ``cp_group``: the context-parallel group whose ranks hold the other shares of each row (``None``
    without CP)."""

    def __init__(self, cp_group: Optional[object] = None) -> None:
        self.cp_group = cp_group
        self.pending: dict[int, tuple[torch.Tensor, list]] = {}

    def add(self, target: torch.Tensor, mb, local: torch.Tensor, *, whole=None) -> None:
        """``target[mb.rows]`` := the micro-batch's output ``local`` (this rank's tokens; ``whole``: already
        whole rows, as the attention capture returns them), cut to the batch's ``T``, at :meth:`flush`."""
        full = whole[: len(mb.rows)] if whole is not None else mb.whole_rows(local, cp_group=self.cp_group)
        n = min(full.shape[1], target.shape[1])  # a micro-batch may be padded past T
        part = full[:, :n].detach().to(target.dtype)
        self.pending.setdefault(id(target), (target, []))[1].append((list(mb.rows), part))

    def flush(self) -> None:
        for target, parts in self.pending.values():
            if all(p.device == target.device for _, p in parts):
                host = [p for _, p in parts]
            else:  # one copy of all the parts, split again on the host
                flat = torch.cat([p.reshape(-1) for _, p in parts]).to(target.device)
                host = [h.view(p.shape) for h, (_, p) in zip(flat.split([p.numel() for _, p in parts]), parts)]
            for (rows, p), h in zip(parts, host):
                target[rows, : p.shape[1]] = h
        self.pending = {}
