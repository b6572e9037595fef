"""Gradient reduction without megatron's DDP (which needs CUDA buffers and streams).

``finalize_gradients`` makes every rank's ``.grad`` the gradient of the summed loss of all ranks: a sum
over DP x CP, over TP for parameters replicated there whose ranks saw different inputs (q/k norms, norms
under sequence parallelism), and over the embedding group for tied embeddings across pipeline stages.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` in place over ``group`` with one collective on a flat buffer.

    Every rank of ``group`` must pass tensors of the same shapes in the same order.
    """
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _grads_for_reduce(params: Iterable[torch.nn.Parameter], group) -> list[torch.Tensor]:
    """``.grad`` of every ``requires_grad`` param in the given order; a missing grad (the param was
    unused on this rank) becomes zeros, so every rank's flat buffer has the same layout."""
    params = [p for p in params if p.requires_grad]
    if dist.get_world_size(group) > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], *, group) -> None:
    """Sum ``.grad`` of the ``requires_grad`` ``params`` over ``group`` (one flat buffer, one
    collective). Every rank passes the same parameters in the same order; a ``None`` grad counts as
    zeros (and is materialised) when the group has more than one rank."""
    _all_reduce_flat(_grads_for_reduce(params, group), group)


def finalize_gradients(model: torch.nn.Module, *, dp_cp_group, tp_group,
                       embedding_group=None) -> None:
    """Make ``.grad`` the gradient of the summed loss of all ranks (the CPU stand-in for megatron
    DDP + ``finalize_model_grads``, which need CUDA buffers).

    - ``dp_cp_group`` (``get_data_parallel_group(with_context_parallel=True)``): every DP and CP rank
      holds the gradient of its own samples / tokens for the same parameters: sum.
    - ``tp_group``: per-head q/k norms are replicated over TP but each rank only sees its own heads
      (and under sequence parallelism, norms only see their sequence shard): sum, as
      ``finalize_model_grads._allreduce_non_tensor_model_parallel_grads`` does.
    - ``embedding_group`` (tied embeddings across pipeline stages, ``get_embedding_group()``; pass
      it only on ranks in that group): the first stage's input embedding and the last stage's
      output copy are one parameter: sum.
    """
    config = model.config
    # All trainable params in module order (the same on every rank of a group), not only those
    # with a grad: a param unused on one rank must still take its slot in the flat buffers.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    all_reduce_gradients([p for _, p in named], group=dp_cp_group)
    tp_summed = [p for n, p in named
                 if (config.qk_layernorm and ("q_layernorm" in n or "k_layernorm" in n))
                 or (config.sequence_parallel and getattr(p, "sequence_parallel", False))]
    all_reduce_gradients(tp_summed, group=tp_group)
    if embedding_group is not None and getattr(model, "share_embeddings_and_output_weights", False):
        shared = model.shared_embedding_or_output_weight()
        if shared is not None:
            all_reduce_gradients([shared], group=embedding_group)
