"""Worker-side half of the vLLM engine's weight sync: a vLLM ``worker_extension_cls``.

vLLM (>= 0.8, V1 engine) mixes this class into each of its GPU workers when the engine is built with
``worker_extension_cls="megatron_credit.rollout.vllm_worker.WeightSyncExtension"``; the driver then
reaches its methods with ``LLM.collective_rpc(name, args=...)``, which runs them on every worker of
the engine's tensor-parallel group. Each worker receives the full HF-named tensors of a bucket and
hands them to vLLM's own ``model.load_weights``, whose per-parameter weight loaders cut the
tensor-parallel shards and fuse q/k/v and gate/up -- so the actor never needs to know vLLM's layout.

This module imports nothing from vLLM (and only torch) so that it can be imported, and its docstring
tested, on machines without vLLM. NOT RUN on the CPU machines this was written on (see
``megatron_credit.rollout.vllm_engine``).
"""
from __future__ import annotations

import torch


class WeightSyncExtension:
    """Methods mixed into vLLM's GPU worker; ``self`` is the worker (``self.model_runner``, ``self.device``)."""

    def load_hf_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of HF-named tensors into this worker's model; returns the tensor count."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = self.device  # type: ignore[attr-defined]
        loaded = model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in named_tensors))
        torch.cuda.synchronize(device)
        # vLLM returns the set of parameter names it filled (fused names, e.g. qkv_proj), or None.
        return len(named_tensors) if loaded is None else len(loaded)

    def hf_weight_names(self) -> list[str]:
        """The worker model's own parameter names (vLLM naming), for diagnostics."""
        return [name for name, _ in self.model_runner.model.named_parameters()]  # type: ignore[attr-defined]
