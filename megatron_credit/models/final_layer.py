"""The final decoder layer records CompPO's attention statistics during the behaviour-policy forward.

CompPO's gate needs ``H_t`` (and its critic the top-K keys) of the final layer's causal attention for
response queries. Rather than a second model forward, the GLOBAL last decoder layer gets a core
attention that is the spec's own class (megatron's ``DotProductAttention``, our
``CpuContextParallelAttention`` under CP on CPU, TE's ``TEDotProductAttention`` on GPU) subclassed
at build time: its ``forward`` calls the parent unchanged — the layer output, hence the logits, is
bit-identical — and, only while a :class:`FinalAttentionCapture` is armed, computes from the q/k it was
handed (after RoPE; ``[s, b, heads, d]``, GQA key groups) the statistics of
:mod:`megatron_credit.models.concentration`. Unarmed, the forward costs one attribute check.

Parallelism (the groups are captured from megatron ``parallel_state`` at build time or passed in):

- TP: each rank holds its query heads and their key groups; ``H`` all-reduces the head mean, the top-k
  all-gathers heads, so every TP rank holds the same result.
- CP: megatron's load-balanced chunk order (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``).
  K is all-gathered over the CP group into sequence order (``[S, b, ng, d]``: one layer's keys), each
  rank scores its own queries at their global positions, and the small results are summed into global
  order (each position is written by exactly one rank), so every CP rank holds the same result.
- Packed micro-batches (THD, ``batch/packing.py``): each sequence's queries against its own keys only (under
  CP its keys gathered into stream order), and the result is whole rows, one per sequence.
- PP: only the last stage holds the layer; ``capture.present`` is False elsewhere and ``result`` stays
  None. Sequence parallelism needs nothing: inside attention q/k cover the (CP-local) full sequence.

Usage (the trainer, once per behaviour-policy micro-batch, reading the result in the loss function)::

    capture = model.final_attention_capture      # None unless built with capture_final_attention=True
    capture.arm(query_start=prompt_len, top_k=64)   # clears the previous result
    logits = model(input_ids, position_ids, None)
    capture.disarm()                                 # stops recording; the result stays
    stats = capture.result   # {"H": [b, S - q0], "n": ..., "topk_idx": [b, S - q0, k], "topk_w": ...}
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_credit.batch.cp_chunks import load_balanced_positions, merge_cp_shards
from megatron_credit.models.concentration import attention_statistics

__all__ = ["FinalAttentionCapture", "capturing_core_attention", "final_layer_spec", "decoder_block_spec",
           "gather_cp_sequence", "scatter_to_global"]


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@torch.no_grad()
def gather_cp_sequence(local: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """CP shard ``[2c, ...]`` (chunks r, 2cp-1-r) -> full sequence ``[2 cp c, ...]`` in order, and this
    rank's global positions ``[2c]`` on the host (the capture selects its queries there: no device read).
    Without a group (or CP = 1): ``local`` and ``arange(2c)``."""
    cp = _size(group)
    if cp == 1:
        return local, torch.arange(local.shape[0])
    rank = dist.get_rank(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    positions = load_balanced_positions(local.shape[0], cp_rank=rank, cp_size=cp)
    return merge_cp_shards(parts, seq_dim=0), positions


@torch.no_grad()
def scatter_to_global(values: torch.Tensor, columns: torch.Tensor, width: int, group) -> torch.Tensor:
    """``values [b, m, ...]`` at global columns ``columns [m]`` -> ``[b, width, ...]``, summed over
    ``group``: exact when every column is written by exactly one rank (zeros elsewhere)."""
    out = values.new_zeros((values.shape[0], width) + tuple(values.shape[2:]))
    out[:, columns] = values
    if _size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


@dataclasses.dataclass(kw_only=True, eq=False)
class FinalAttentionCapture:
    """Arms the final layer's core attention to record ``H``, ``n`` and the top-k during a forward."""

    tp_group: Any = None
    """Tensor-parallel group (None: heads are not split)."""
    cp_group: Any = None
    """Context-parallel group (None: the sequence is not split)."""
    chunk_size: int = 1024
    """Query / key tile of the streamed kernels (memory ~ B * heads * chunk_size**2 * 4 bytes)."""
    present: bool = False
    """Whether this pipeline stage holds the global last layer (set by the model build)."""
    query_start: Optional[int] = None
    """First GLOBAL position scored while armed; None = disarmed."""
    top_k: int = 0
    """Top-k keys to return per query (0: none)."""
    sink_keys: int = 0
    """Attention-sink keys (the first positions) left out of ``H``, renormalised (0: none; set by :meth:`arm`)."""
    result: Optional[dict] = None
    """After an armed forward on the last stage: ``H [b, S - query_start]`` float32, ``n`` int64 and,
    if ``top_k``, ``topk_idx [b, S - query_start, top_k]`` int64 / ``topk_w`` float32."""

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def armed(self) -> bool:
        return self.query_start is not None

    def arm(self, query_start: int, top_k: int = 0, sink_keys: int = 0) -> None:
        """Record the next forwards' statistics for global positions ``query_start .. S-1`` (``H``
        without the first ``sink_keys`` keys, ``models.concentration``)."""
        if query_start < 0:
            raise ValueError(f"query_start must be >= 0, got {query_start}")
        if top_k < 0 or sink_keys < 0:
            raise ValueError(f"top_k and sink_keys must be >= 0, got {top_k}, {sink_keys}")
        self.query_start, self.top_k, self.result = int(query_start), int(top_k), None
        self.sink_keys = int(sink_keys)

    def disarm(self) -> None:
        """Stop recording. ``result`` keeps the last armed forward's statistics until the next
        :meth:`arm` (which clears it), so a trainer may disarm right after the forward and read it in
        the loss function megatron's schedule calls afterwards."""
        self.query_start = None

    @torch.no_grad()
    def record(self, query: torch.Tensor, key: torch.Tensor, *, scale: float, packed_seq_params=None) -> None:
        """Compute ``result`` from the layer's ``query [sq, b, np, d]`` and ``key [sq, b, ng, d]``; packed
        (``packed_seq_params``, THD): ``query [t, np, d]``, ``key [t, ng, d]``, see :meth:`_record_packed`."""
        if packed_seq_params is not None:
            return self._record_packed(query, key, scale=scale, params=packed_seq_params)
        key, positions = gather_cp_sequence(key, self.cp_group)  # [S, b, ng, d], [sq]
        width = key.shape[0] - self.query_start
        if width <= 0:
            raise ValueError(f"query_start={self.query_start} must be below the sequence length {key.shape[0]}")
        mine = torch.nonzero(positions >= self.query_start).flatten()  # on the host
        q = query[mine.to(query.device)].permute(1, 2, 0, 3)  # [b, np, m, d]
        k = key.permute(1, 2, 0, 3)  # [b, ng, S, d]
        kw = dict(scale=scale, chunk_size=self.chunk_size, tp_group=self.tp_group, q_positions=positions[mine])
        stats = attention_statistics(q, k, self.top_k, sink_keys=self.sink_keys, **kw)  # H, n (, idx, w)
        cols = (positions[mine] - self.query_start).to(query.device)
        self.result = {name: scatter_to_global(x, cols, width, self.cp_group)
                       for name, x in zip(("H", "n", "topk_idx", "topk_w"), stats)}


    def _record_packed(self, query: torch.Tensor, key: torch.Tensor, *, scale: float, params) -> None:
        """A packed stream (``batch/packing.py``): each sequence's queries from position ``query_start`` of
        that sequence on, against that sequence's keys only (gathered over CP into stream order). ``result``
        holds whole rows from position 0, one per sequence: ``H [n, P]`` (0 before ``query_start``), ...,
        with ``P`` the longest sequence's padded length."""
        from megatron_credit.batch.packing import PackedIndex, host_cu_seqlens, rank_indices

        cu = host_cu_seqlens(params)
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        cp = _size(self.cp_group)
        rank = dist.get_rank(self.cp_group) if cp > 1 else 0
        index = PackedIndex.build(lens, multiple=2 * cp if cp > 1 else 1, cp_size=cp, cp_rank=rank)
        if cp > 1:  # every sequence's keys, in stream order
            parts = [torch.empty_like(key) for _ in range(cp)]
            dist.all_gather(parts, key.contiguous(), group=self.cp_group)
            full = key.new_empty((cu[-1], *key.shape[1:]))
            for idx, part in zip(rank_indices(cu, cp_size=cp), parts):
                full[idx.to(key.device)] = part
            key = full
        width = max(lens)
        if width <= self.query_start:
            raise ValueError(f"query_start={self.query_start} must be below the longest sequence's length {width}")
        out: dict[str, torch.Tensor] = {}

        def put(name: str, seqs: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
            if name not in out:
                out[name] = values.new_zeros((len(lens), width, *values.shape[2:]))
            out[name][seqs[:, None], cols[None, :]] = values

        # Sequences of one length have the same local positions (PackedIndex: they depend on the length
        # alone), so their queries and keys are stacked into one call, [g, np, m, d] and [g, ng, L, d]: each
        # sequence's statistics are those of a call of its own bit for bit (tests/models/test_concentration.py),
        # in a handful of kernels instead of a handful per sequence.
        local0 = [0]
        for length in lens:
            local0.append(local0[-1] + length // cp)
        by_length: dict[int, list[int]] = {}
        for k, length in enumerate(lens):
            by_length.setdefault(length, []).append(k)
        for length, seqs in by_length.items():  # the same groups on every TP rank: the TP collectives match
            n_local = length // cp
            pos = index.positions[local0[seqs[0]]:local0[seqs[0]] + n_local]  # on the host: no device read
            mine = torch.nonzero(pos >= self.query_start).flatten()
            if not len(mine):
                continue
            q_idx = torch.stack([local0[k] + mine for k in seqs])  # [g, m] local stream indices
            k_idx = torch.stack([torch.arange(cu[k], cu[k] + length) for k in seqs])  # [g, L] whole-stream indices
            q = query[q_idx.to(query.device)].permute(0, 2, 1, 3)  # [g, np, m, d]
            keys = key[k_idx.to(key.device)].permute(0, 2, 1, 3)  # [g, ng, L, d]
            kw = dict(scale=scale, chunk_size=self.chunk_size, tp_group=self.tp_group, q_positions=pos[mine])
            stats = attention_statistics(q, keys, self.top_k, sink_keys=self.sink_keys, **kw)  # H, n (, idx, w)
            rows, cols = torch.tensor(seqs, device=query.device), pos[mine].to(query.device)
            for name, x in zip(("H", "n", "topk_idx", "topk_w"), stats):
                put(name, rows, cols, x)
        templates = {"H": (torch.float32, ()), "n": (torch.long, ())}
        if self.top_k:
            templates.update({"topk_idx": (torch.long, (self.top_k,)), "topk_w": (torch.float32, (self.top_k,))})
        for name, (dtype, tail) in templates.items():  # a rank without any query of one: zeros
            out.setdefault(name, torch.zeros((len(lens), width, *tail), dtype=dtype, device=query.device))
            if cp > 1:
                dist.all_reduce(out[name], group=self.cp_group)  # each position written by one rank
        self.result = out


def capturing_core_attention(base: type, capture: FinalAttentionCapture) -> type:
    """A subclass of the core-attention class ``base`` whose forward also feeds ``capture`` when armed.

    ``base`` keeps its constructor and its forward; the scale is the one megatron's attention gives its
    core attention (``config.softmax_scale`` or ``1/sqrt(kv_channels)``; query-key layer scaling
    divides and re-multiplies by the layer number inside ``DotProductAttention``, leaving it unchanged).
    """

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        config = kwargs["config"] if "config" in kwargs else args[0]
        scale = kwargs.get("softmax_scale") or config.softmax_scale
        self.capture_scale = 1.0 / math.sqrt(config.kv_channels) if scale is None else float(scale)

    def forward(self, query, key, value, *args, **kwargs):
        if capture.armed:  # before the parent's forward: it sees q/k exactly as the parent does
            capture.record(query, key, scale=self.capture_scale, packed_seq_params=kwargs.get("packed_seq_params"))
        return base.forward(self, query, key, value, *args, **kwargs)

    return type(f"Capturing{base.__name__}", (base,), {"__init__": __init__, "forward": forward,
                                                      "__module__": __name__, "__doc__": base.__doc__})


def final_layer_spec(layer_spec, capture: FinalAttentionCapture):
    """A copy of ``layer_spec`` whose core attention is ``capturing_core_attention(<its class>)``."""
    spec = copy.deepcopy(layer_spec)
    attention = getattr(getattr(spec.submodules, "self_attention", None), "submodules", None)
    if not hasattr(attention, "core_attention"):
        raise RuntimeError("megatron-core's layer spec has no submodules.self_attention.submodules."
                           "core_attention: the final-layer capture cannot be placed (models/final_layer.py)")
    core = attention.core_attention
    if isinstance(core, type):
        attention.core_attention = capturing_core_attention(core, capture)
    else:  # a ModuleSpec: keep its params and submodules, swap the class
        attention.core_attention = dataclasses.replace(core, module=capturing_core_attention(core.module, capture))
    return spec


def decoder_block_spec(transformer_config, layer_spec, capture: FinalAttentionCapture, *, pp_rank: int):
    """``TransformerBlockSubmodules`` of pipeline rank ``pp_rank``: ``layer_spec`` for its layers, the
    capturing spec for the GLOBAL last layer if this stage holds it (sets ``capture.present``).

    megatron-core 0.16 - 0.19 take the local stage's layers from ``layer_specs`` and number them
    ``offset + i + 1`` with ``get_transformer_layer_offset``; ``_get_block_submodules`` gives the block
    (and its final norm class) the plain spec would have had, of which only the last entry changes.
    """
    from megatron.core.transformer.transformer_block import (_get_block_submodules,
                                                             get_num_layers_to_build)
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if getattr(transformer_config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError("capture_final_attention does not support virtual pipeline stages "
                         "(parallel.virtual_pipeline_model_parallel_size)")
    block = _get_block_submodules(transformer_config, layer_spec, None, pp_rank)
    block = dataclasses.replace(block, layer_specs=list(block.layer_specs))
    n_local = get_num_layers_to_build(transformer_config, vp_stage=None, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(transformer_config, vp_stage=None, pp_rank=pp_rank)
    assert len(block.layer_specs) == n_local, (len(block.layer_specs), n_local)
    capture.present = n_local > 0 and offset + n_local == transformer_config.num_layers
    if capture.present:
        block.layer_specs[-1] = final_layer_spec(block.layer_specs[-1], capture)
    return block
