"""LoRA adapters on megatron's tensor-parallel linears: ``y = x W^T + (x A^T B^T) * alpha / rank``.

Each adapted linear keeps its weight, frozen, under its own name; the adapter is a child module ``lora`` of
the linear (``...linear_qkv.lora.a`` ``[r, in]``, ``...linear_qkv.lora.b`` ``[out, r]``), and a forward hook
adds its output to the linear's. The adapter is split the way its base weight is split over TP:

- column-parallel (``linear_qkv``, ``linear_fc1``; weight ``[out / tp, in]``): ``A`` whole on every TP rank,
  ``B`` split by output rows as the weight is (a gated fc1 holds ``[gate_r; up_r]`` on rank r: megatron's
  partition stride 2, and its checkpoint entry goes through megatron's SwiGLU factory as the weight's does). ``x A^T`` (``[s, b, r]``) enters the TP region as the base's input does:
  copied (backward: summed over TP), or under sequence parallelism all-gathered along the sequence
  (backward: reduce-scattered). Every rank then owns its rows of the output.
- row-parallel (``linear_proj``, ``linear_fc2``; weight ``[out, in / tp]``): ``A`` split by input columns,
  ``B`` whole. Each rank's ``x_tp A_tp^T`` is a partial sum, reduced over TP as the base's output is:
  all-reduced, or under sequence parallelism reduce-scattered along the sequence.

So only ``[s, b, r]`` tensors cross ranks, and the result is the same at every TP size (with and without
SP). A parameter that is whole on every TP rank but sees a sequence shard under SP (``A`` of a column
linear, ``B`` of a row one) carries ``sequence_parallel = True``: megatron's ``finalize_model_grads`` sums its
gradient over TP, as it does a norm's. The split ones carry megatron's ``tensor_model_parallel`` attributes,
so gradient norms count them on every rank and the whole ones once.

Initialisation (PEFT's): ``A`` Kaiming-uniform (bound ``1 / sqrt(in)``), ``B`` zero, so an adapted model starts
as its base. ``A`` is drawn whole from a generator seeded by the run's seed and the linear's global name
(its layer index counted over all pipeline stages), then sliced: every layout starts from the same
adapters. The adapters are fp32 whatever the base's dtype (``model.params_dtype``).

Experts of a mixture-of-experts layer (``mlp.experts``) are left frozen: their linears communicate through
the token dispatcher (``explicit_expert_comm``), which this hook does not follow. The router and a shared
expert's linears are as the recipe's targets say (a shared expert's ``linear_fc1`` / ``linear_fc2`` are adapted).

:func:`adapters_off` runs the model as its base (the KL reference of a LoRA run: no second model held);
:func:`merged_weight` is ``W + B A * alpha / rank`` of one rank's shard, in ``W``'s dtype, and
:class:`MergedState` the state dict the rollout engine's weights are read from; :func:`base_state` is a
state dict without the adapters.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import zlib
from collections.abc import Mapping
from typing import Iterator, Optional

import torch

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
TARGETS = COLUMN_TARGETS + ROW_TARGETS
"""megatron's module names of the projections an adapter may sit on: attention's QKV and output, the MLP's
in (gate and up) and out (down)."""

ADAPTER = "lora"
"""The child module's name inside an adapted linear."""


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or state-dict entry) of the model belongs to an adapter.

    >>> is_adapter_name("decoder.layers.0.self_attention.linear_qkv.lora.a"), is_adapter_name("decoder.final_layernorm.weight")
    (True, False)
    """
    return f".{ADAPTER}." in f".{name}"


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one megatron linear (``kind``: ``"column"`` or ``"row"``) on one TP rank."""

    def __init__(self, *, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float, tp_size: int, tp_rank: int, tp_group, sequence_parallel: bool,
                 generator: torch.Generator, stride: int = 1, device=None):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"LoRA adapter kind {kind!r}: 'column' or 'row'")
        self.kind, self.rank, self.scale = kind, rank, alpha / rank
        self.tp_size, self.tp_group, self.sequence_parallel = tp_size, tp_group, sequence_parallel and tp_size > 1
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), PEFT's and nn.Linear's
        a = (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        if kind == "row":
            if in_features % tp_size:
                raise ValueError(f"LoRA: {in_features} input features do not split over TP {tp_size}")
            part = in_features // tp_size
            a = a[:, tp_rank * part:(tp_rank + 1) * part]
            b_rows = out_features
        else:
            if out_features % tp_size:
                raise ValueError(f"LoRA: {out_features} output features do not split over TP {tp_size}")
            b_rows = out_features // tp_size
        self.a = torch.nn.Parameter(a.to(torch.float32).contiguous().to(device))
        self.b = torch.nn.Parameter(torch.zeros(b_rows, rank, dtype=torch.float32, device=device))
        split, whole = (self.b, self.a) if kind == "column" else (self.a, self.b)
        # megatron's attributes: the split one is TP-parallel along its dim; the whole one, under SP, sees
        # a sequence shard and is summed over TP by finalize_model_grads.
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = tp_size > 1, \
            (0 if kind == "column" else 1), stride
        if self.sequence_parallel:
            whole.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``(x A^T B^T) * scale`` for the linear's input ``x`` (this rank's part of its output)."""
        from megatron.core.tensor_parallel import mappings

        h = x.to(self.a.dtype)
        if self.dropout is not None:
            h = self.dropout(h)
        xa = torch.nn.functional.linear(h, self.a)
        if self.tp_size > 1:
            if self.kind == "column":
                xa = (mappings.gather_from_sequence_parallel_region(xa, group=self.tp_group) if self.sequence_parallel
                      else mappings.copy_to_tensor_model_parallel_region(xa, group=self.tp_group))
            else:
                xa = (mappings.reduce_scatter_to_sequence_parallel_region(xa, group=self.tp_group)
                      if self.sequence_parallel else mappings.reduce_from_tensor_model_parallel_region(xa, group=self.tp_group))
        return torch.nn.functional.linear(xa, self.b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """``B A * scale`` for this rank's shard of the base weight (fp32)."""
        return (self.b @ self.a) * self.scale


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on the gradient contiguous with a row-major stride in every dim
    (``contiguous()`` keeps any stride of a size-1 dim: ``[s, 1, h]`` transposed from ``[1, s, h]`` is
    "contiguous" with strides ``(h, s * h, 1)``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().view(-1).view(grad.shape)  # the same memory, strides recomputed


def _contiguous_grad(linear, inputs, output):
    """Forward hook of a frozen megatron linear. Its backward (``LinearWithFrozenWeight``) computes
    ``grad_output.matmul(weight)`` on the gradient as it arrives, unlike a trained linear's backward, which
    views it as a matrix first. ``matmul`` folds ``[s, b, h]`` into one ``[s * b, h]`` product only when the
    strides are row-major; a micro-batch of one sequence (``b = 1``) often reaches it with the stride of the
    ``[b, s]`` dim order it was transposed from, and ``matmul`` then copies the weight once per position into a
    batched product (on CPU: a LoRA update of SmolLM2-135M took 6x a full fine-tuning one)."""
    if isinstance(output, tuple):
        return (_ContiguousGrad.apply(output[0]), *output[1:])
    return _ContiguousGrad.apply(output)


def _add_update(linear, inputs, output):
    """Forward hook of an adapted linear: its output plus the adapter's (when the adapters are on)."""
    adapter = getattr(linear, ADAPTER)
    if not adapter.enabled:
        return output
    out, bias = output if isinstance(output, tuple) else (output, None)
    out = out + adapter(inputs[0]).to(out.dtype)
    return (out, bias) if isinstance(output, tuple) else out


def _sharded_state_dict(linear, own, gated: bool, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
    """An adapted linear's megatron sharded state dict: its own (``own``), where the linear declares every
    entry but its weight and bias whole on each TP rank, with the adapter's split parameter declared split
    along its TP axis (``gated``: a gated MLP's fc1, whose ``B`` rows go through megatron's SwiGLU factory as
    its weight's do), so a checkpoint reshards the adapters like the base."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    state = own(prefix, sharded_offsets, metadata)
    adapter = getattr(linear, ADAPTER)
    p, axis = (adapter.b, 0) if adapter.kind == "column" else (adapter.a, 1)
    key = f"{prefix}{ADAPTER}.{'b' if adapter.kind == 'column' else 'a'}"
    entry = make_tp_sharded_tensor_for_checkpoint(p, key, tp_axis=axis, prepend_offsets=sharded_offsets)
    if gated:  # [gate_r; up_r] rows
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        entry = apply_swiglu_sharded_factory(entry, sharded_offsets)
    state[key] = entry
    return state


def _kind(name: str) -> Optional[str]:
    last = name.rsplit(".", 1)[-1]
    return "column" if last in COLUMN_TARGETS else "row" if last in ROW_TARGETS else None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _global_name(name: str, layer_offset: int) -> str:
    """``decoder.layers.3.x`` on a stage whose first layer is 8 -> ``decoder.layers.11.x``."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def attach(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float, targets, seed: int,
           layer_offset: int, tp_size: int, tp_rank: int, tp_group, sequence_parallel: bool) -> list[str]:
    """Freeze ``model`` and put an adapter on each linear named in ``targets`` (of :data:`TARGETS`); returns
    the adapted linears' names. Experts' linears are skipped (module docstring). Every parameter of the
    model is frozen first; the caller re-enables what else trains (a value head)."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"model.lora.targets: unknown {unknown}; megatron's projections are {list(TARGETS)}")
    model.requires_grad_(False)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.register_forward_hook(_contiguous_grad)
    device = next(model.parameters()).device
    adapted = []
    for name, module in list(model.named_modules()):
        kind = _kind(name)
        if kind is None or name.rsplit(".", 1)[-1] not in targets or not hasattr(module, "weight"):
            continue
        if ".mlp.experts." in f".{name}" or getattr(module, "is_expert", False):
            continue  # routed experts: their communication is the dispatcher's (module docstring)
        if type(module).__name__.startswith("TELayerNorm"):
            raise ValueError(f"LoRA on {name}: a Transformer Engine linear with its norm fused in reads the input "
                             "before the norm; build the model with unfused_norms=True (models/gpt.py)")
        out_local, in_local = module.weight.shape
        # the base's TP split: a gated MLP's fc1 holds [gate_r; up_r] on rank r (megatron's stride 2), and B's
        # rows follow the weight's
        stride = getattr(module.weight, "partition_stride", 1) if kind == "column" else 1
        in_features, out_features = (in_local, out_local * tp_size) if kind == "column" else (in_local * tp_size, out_local)
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(_global_name(name, layer_offset).encode())) % (2**63))
        adapter = LoraAdapter(kind=kind, in_features=in_features, out_features=out_features, rank=rank, alpha=alpha,
                              dropout=dropout, tp_size=tp_size, tp_rank=tp_rank, tp_group=tp_group,
                              sequence_parallel=sequence_parallel, generator=g, stride=stride, device=device)
        adapter.enabled = True
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_update)
        gated = name.endswith("linear_fc1") and getattr(module.config, "gated_linear_unit", False)
        module.sharded_state_dict = functools.partial(_sharded_state_dict, module, module.sharded_state_dict, gated)
        adapted.append(name)
    return adapted


def adapters(model: torch.nn.Module) -> Iterator[tuple[str, LoraAdapter]]:
    """``(linear's name, adapter)`` of each adapted linear of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter):
            yield name.rsplit(".", 1)[0], module


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Run ``model`` as its frozen base inside the block (the adapters' hooks add nothing)."""
    found = [a for _, a in adapters(model)]
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(found, before):
            a.enabled = was


def merged_weight(linear) -> torch.Tensor:
    """This rank's ``W + B A * alpha / rank`` of an adapted linear, in ``W``'s dtype (a new tensor)."""
    adapter = getattr(linear, ADAPTER)
    w = linear.weight.detach()
    return (w.to(torch.float32) + adapter.delta_weight().detach()).to(w.dtype)


def base_state(model: torch.nn.Module, *, keep_vars: bool = False) -> dict:
    """``model.state_dict()`` without the adapters' entries."""
    return {k: v for k, v in model.state_dict(keep_vars=keep_vars).items() if not is_adapter_name(k)}


class MergedState(Mapping):
    """:func:`base_state` of a model in which each adapted linear's weight reads as :func:`merged_weight`,
    computed when it is read (one merged weight alive at a time, not a merged copy of the stage)."""

    def __init__(self, model: torch.nn.Module, *, skip: Optional[str] = None):
        """``skip``: leave out the entries whose names start with it (a value head)."""
        self._state = {k: v for k, v in base_state(model).items() if not (skip and k.startswith(skip))}
        self._adapted = {f"{name}.weight": model.get_submodule(name) for name, _ in adapters(model)}

    def __getitem__(self, key: str) -> torch.Tensor:
        linear = self._adapted.get(key)
        return self._state[key] if linear is None else merged_weight(linear)

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def adapter_parameter_count(model: torch.nn.Module) -> int:
    """The adapters' parameters on this rank."""
    return sum(p.numel() for _, a in adapters(model) for p in a.parameters())
