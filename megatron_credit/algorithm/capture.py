"""What an algorithm reads inside the forward pass: a :class:`Capture`.

The trainer knows one seam and no algorithm: before the behaviour pass's forward of a micro-batch it calls
``capture.arm(model_chunk, microbatch)`` on the last pipeline stage, and after it
``capture.collect(microbatch) -> {name: tensor}``. Each output is whole rows ``[b, seq_len, *trailing]``,
identical on every TP / CP rank, and goes into the batch's side channel (``TrainBatch.extras``) under its
name. From there it travels like any side channel: cut into the update's micro-batches, read by the
algorithm before its estimator (:meth:`~megatron_credit.algorithm.base.Algorithm.advantage_inputs`),
by a feature critic (its ``forward`` keywords), and by a policy loss that names it in its
``side_channels``.

:class:`FinalLayerCapture` is the common case: the final decoder layer's attention statistics
(``models/final_layer.py``: the concentration ``H``, the key count ``n`` and the top-K keys), read during
the pass that computes the old log-probs, at no second forward. CompPO's gate (``algorithm/comppo.py``: ``GateCapture``) is one;
a plugin reads the same statistics with a subclass of its own (``examples/plugins/attention_entropy_grpo.py``).
No megatron import: the model chunk is what the trainer hands over.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch


@dataclasses.dataclass(frozen=True)
class CaptureOutput:
    """The shape of one output beyond ``[B, T]``, and its dtype: what the batch allocates for it."""

    dtype: torch.dtype = torch.float32
    trailing: tuple[int, ...] = ()


class Capture:
    """What an algorithm reads inside the behaviour pass's forward (module docstring)."""

    model_options: Mapping[str, Any] = {}
    """Keywords the model is built with (``models.build_gpt_model``), e.g. the final layer's capture."""

    @property
    def outputs(self) -> Mapping[str, CaptureOutput]:
        """Every name :meth:`collect` returns, with its dtype and trailing shape."""
        raise NotImplementedError

    @property
    def critic_inputs(self) -> tuple[str, ...]:
        """The outputs a feature critic's ``forward`` takes as keywords (default: all of :attr:`outputs`)."""
        return tuple(self.outputs)

    def arm(self, model_chunk: Any, microbatch: Any) -> None:
        """Before the forward of ``microbatch`` through ``model_chunk`` (this rank's last stage)."""
        raise NotImplementedError

    def collect(self, microbatch: Any) -> dict[str, torch.Tensor]:
        """After that forward: ``{name: [b, seq_len, *trailing]}`` whole rows of the micro-batch."""
        raise NotImplementedError


def whole_rows(x: torch.Tensor, microbatch: Any, fill=0) -> torch.Tensor:
    """The final layer's per-query result of ``microbatch`` (queries from its ``query_start`` on) as whole
    rows ``[b, seq_len, ...]``, ``fill`` before ``query_start``. A packed micro-batch's result is already
    one whole row per sequence."""
    q0 = microbatch.query_start
    if microbatch.packed:
        before = torch.arange(x.shape[1], device=x.device) < q0
        return x.masked_fill(before.view(1, -1, *([1] * (x.dim() - 2))), fill)
    full = x.new_full((microbatch.num_rows, microbatch.seq_len, *x.shape[2:]), fill)
    full[:, q0:] = x
    return full


class FinalLayerCapture(Capture):
    """A capture of the final decoder layer's attention statistics (``models/final_layer.py``):
    :meth:`read` maps its raw result (``H``, ``n``: ``[b, q]``; with ``top_k`` > 0 ``topk_idx``,
    ``topk_w``: ``[b, q, K]``, for the ``q`` queries from ``query_start``) to this capture's outputs;
    ``sink_keys``: the first keys left out of ``H``."""

    model_options = {"capture_final_attention": True}

    def __init__(self, *, top_k: int = 0, sink_keys: int = 0) -> None:
        self.top_k, self.sink_keys = int(top_k), int(sink_keys)
        self._layer = None

    def read(self, result: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def arm(self, model_chunk: Any, microbatch: Any) -> None:
        self._layer = model_chunk.final_attention_capture
        self._layer.arm(query_start=microbatch.query_start, top_k=self.top_k, sink_keys=self.sink_keys)

    def collect(self, microbatch: Any) -> dict[str, torch.Tensor]:
        layer, self._layer = self._layer, None
        result = layer.result
        layer.disarm()
        return {k: whole_rows(v, microbatch) for k, v in self.read(result).items()}
