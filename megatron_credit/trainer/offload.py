"""What a trainer rank gives up while the colocated rollout engine generates, and takes back before it
trains: the optimizer's states go to host memory and the gradient buffers are released.

During generation a rank keeps only the model's weights (the engine is synced from them) and, for the
references of KL terms, the reference model. Everything the optimizer owns (Adam's moments, the fp32
masters of a bf16 model, megatron's fp32 main parameters) is copied to (pinned) host memory, and the
fp32 gradient buffers of megatron's DDP (zero between iterations: every optimizer step ends with
``zero_grad_buffer``) have their storage released and re-made as zeros afterwards, as verl and slime do
for megatron. Then the allocator's cached blocks are given back (``empty_cache``), so the engine that
wakes next finds that memory free.

On the CPU there is nothing to give up (the "host" is where the tensors are): both calls are no-ops.
Memory is given up by resizing storages to nothing and back (as verl does for megatron), never by
swapping tensors: every reference (the optimizer's state dict and parameter groups, each parameter's
``main_grad`` view into its DDP buffer, DDP's buckets) stays valid.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from megatron_credit.rollout.engine import empty_cache


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` s inside the trainer's optimizer: ``MasterWeightsAdamW.inner``,
    megatron's ``ChainedOptimizer.chained_optimizers[i].optimizer``, or the optimizer itself."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in torch_optimizers(c)]
    inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None)
    return torch_optimizers(inner) if inner is not None else []


def _storage_key(t: torch.Tensor) -> int:
    """Where ``t``'s memory lives (views of one tensor share it); the tensor itself for a tensor subclass
    without a storage of its own."""
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


def optimizer_tensors(optimizer: Any, model_params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The device tensors the optimizer owns beyond the model's weights: every tensor of its states and
    every parameter of its groups that is not (a view of) a model parameter (fp32 masters / main params)."""
    weights = {_storage_key(p) for p in model_params}
    out: dict[int, torch.Tensor] = {}
    for opt in torch_optimizers(optimizer):
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                    out[id(t)] = t
        for group in opt.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu" and _storage_key(p) not in weights:
                    out[id(p)] = p
    return list(out.values())


def release_storage(t: torch.Tensor) -> int:
    """Free ``t``'s memory, keeping the tensor and its views (their shapes, offsets, every reference);
    returns the bytes freed (0 when its storage is already released). Reading ``t`` before
    :func:`restore_storage` is an error."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes:
        storage.resize_(0)
    return nbytes


def restore_storage(t: torch.Tensor, nbytes: int) -> None:
    """Re-allocate what :func:`release_storage` freed, as zeros."""
    t.untyped_storage().resize_(nbytes)
    t.zero_()


def grad_buffers(ddp: Any) -> list[torch.Tensor]:
    """megatron DDP's contiguous fp32 gradient buffers (``buffers`` and ``expert_parallel_buffers``)."""
    bufs = list(getattr(ddp, "buffers", []) or []) + list(getattr(ddp, "expert_parallel_buffers", []) or [])
    return [b.grad_data for b in bufs if getattr(b, "grad_data", None) is not None]


class GenerationOffload:
    """Offload and restore of the optimizer states and gradient buffers of ``owners`` (objects with
    ``optimizer``, ``ddp``, ``model`` and ``device``: the actor, a separate critic) around generation."""

    def __init__(self, owners: Iterable[Any]):
        self.owners = [o for o in owners if o is not None and torch.device(o.device).type != "cpu"]
        self.device = torch.device(self.owners[0].device) if self.owners else torch.device("cpu")
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._released: list[tuple[torch.Tensor, int]] = []
        self.offloaded_bytes = 0
        """Bytes given up on the device by the last :meth:`offload`."""

    @torch.no_grad()
    def offload(self) -> int:
        """Release the gradient buffers, copy the optimizer's tensors to the host and release theirs, empty
        the allocator's cache; returns the bytes given up on this rank's device (0 on the CPU)."""
        if not self.owners or self._host or self._released:
            return 0
        total = 0
        for o in self.owners:
            for buf in grad_buffers(o.ddp):
                total += self._release(buf)
        pinned = self.device.type == "cuda"  # page-locked host memory: asynchronous copies both ways
        for o in self.owners:
            for t in optimizer_tensors(o.optimizer, o.model.parameters()):
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                host = host.pin_memory() if pinned else host
                host.copy_(t, non_blocking=pinned)
                self._host.append((t, host))
        if pinned:
            torch.cuda.synchronize()  # the copies are done before their sources go
        for t, _ in self._host:
            total += self._release(t)
        empty_cache(self.device)
        self.offloaded_bytes = total
        return total

    def _release(self, t: torch.Tensor) -> int:
        nbytes = release_storage(t)
        if nbytes:  # 0: a storage shared with an earlier tensor, released with it
            self._released.append((t, nbytes))
        return nbytes

    @torch.no_grad()
    def restore(self) -> None:
        """Bring back what :meth:`offload` gave up: every released storage re-allocated (gradient buffers as
        zeros), then the optimizer's tensors copied back from the host."""
        for t, nbytes in self._released:
            restore_storage(t, nbytes)
        for t, host in self._host:
            t.copy_(host, non_blocking=True)
        self._released, self._host = [], []
