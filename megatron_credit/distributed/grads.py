"""Gradients through megatron-core's ``DistributedDataParallel`` (on GPU and, with the CPU shims, on gloo).

``wrap_ddp`` puts a model chunk in megatron's DDP: every trainable parameter gets an fp32 ``main_grad``
view into a contiguous buffer that the backward pass accumulates into (over micro-batches);
``finalize_model_grads([ddp])`` then makes it the gradient of the summed loss of all ranks:

- DP x CP: every DP and CP rank holds the gradient of its own samples / tokens for the same
  parameters. With ``config.calculate_per_token_loss`` DDP's scaling factor is 1: a sum (the losses
  are already shares of the global mini-batch, see ``trainer.actor``).
- TP: per-head q/k norms are replicated over TP but each rank only sees its own heads, and under
  sequence parallelism norms only see their sequence shard: summed (``_allreduce_non_tensor_model_
  parallel_grads``).
- Tied embeddings across pipeline stages: the first stage's input embedding and the last stage's
  output copy are one parameter: summed over the embedding group.

A parameter unused on one rank contributes zeros (its slot in the buffer stays zero).
"""
from __future__ import annotations

from typing import Optional

import torch


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False):
    """megatron DDP around ``model`` (a ``MegatronModule`` with ``.config``): fp32 gradient buffers;
    ``use_distributed_optimizer``: gradients reduce-scattered, parameters in a contiguous buffer that the
    distributed optimizer all-gathers after its step. ``overlap_grad_reduce`` starts each bucket's
    reduction (asynchronous collectives) during the backward pass of the last micro-batch; megatron's
    schedules then run the earlier micro-batches under ``config.no_sync_func`` (set here, with
    ``grad_sync_func`` for the pipelined schedules), and ``finalize`` waits. ``overlap_param_gather``
    (distributed optimizer): the step leaves the all-gather to forward pre-hooks of the next forward;
    :func:`gather_params` forces it before the parameters are read outside a forward.
    On gloo both run as on NCCL (asynchronous work handles; no CUDA streams with one optimizer instance)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                               overlap_param_gather=overlap_param_gather,
                                               use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    if overlap_grad_reduce:
        model.config.no_sync_func, model.config.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
    return ddp


def gather_params(ddp) -> None:
    """With ``overlap_param_gather``: finish the parameter all-gather of the last distributed-optimizer
    step now (synchronously), so the parameters can be read outside a forward pass (weight sync to the
    engine, checkpoints, copies); the next forward's pre-hooks then find it done. A no-op otherwise."""
    if getattr(ddp, "use_forward_hook", False):
        ddp.start_param_sync(force_sync=True)


def finalize(ddp) -> None:
    """Reduce the gradients of ``ddp`` (collective over DP x CP, TP and the embedding group)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])  # no num_tokens: megatron would divide by it


def grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient of ``p``: its DDP ``main_grad`` (fp32) when it has one, else ``.grad``."""
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g
