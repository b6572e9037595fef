"""AdamW with fp32 master weights for bf16 / fp16 models (megatron's mixed-precision optimizer, minus
its CUDA buffers).

A bf16 weight has 8 significant bits: an AdamW update of ``lr = 1e-6`` to a weight of magnitude 0.01
is ~1e-4 of it, below bf16's resolution (2^-8 = 0.4%), so ``torch.optim.AdamW`` on bf16 parameters
rounds most RL updates away. Here the optimizer steps fp32 copies ("masters") and writes them back,
rounded, into the model after each step; the gradients are upcast into the masters' ``.grad``. For an
fp32 model the masters *are* the parameters (no copy, plain AdamW).

The masters are saved in checkpoints next to the moments (``master_param`` in each parameter's
optimizer state) so a resumed bf16 run continues from the exact fp32 weights.

>>> import torch
>>> w = torch.nn.Parameter(torch.full((4,), 0.01, dtype=torch.bfloat16))
>>> opt = MasterWeightsAdamW([{"params": [w]}], lr=1e-6, weight_decay=0.0)
>>> for _ in range(100):
...     w.grad = torch.ones_like(w)
...     opt.step(); opt.zero_grad()
>>> float(opt.masters[0][0]) < 0.01 - 9e-5, float(w[0]) < 0.01   # the plain bf16 AdamW would not move
(True, True)
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


def step_options(masters: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation for ``masters``: fused on CUDA (one kernel per group; the default ``foreach``
    implementation allocates a temporary copy of every parameter during the step, memory an engine
    colocated on the GPU would miss), torch's default elsewhere (the CPU's is the per-parameter loop).

    >>> step_options([torch.zeros(1)])
    {}
    """
    if masters and all(m.device.type == "cuda" for m in masters):
        return {"fused": True}
    return {}


class MasterWeightsAdamW:
    """``torch.optim.AdamW`` over fp32 masters of ``param_groups``' parameters.

    ``param_groups`` / ``state`` / ``state_dict()`` / ``load_state_dict()`` are the inner AdamW's (keyed
    by the masters); :attr:`model_params` lists the model's parameters in the same order as the masters.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], **adamw_kwargs: Any):
        groups = [dict(g) for g in param_groups]
        self.model_params: list[torch.nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        for g in groups:
            masters = []
            for p in g["params"]:
                m = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                self.model_params.append(p)
                self.masters.append(m)
                masters.append(m)
            g["params"] = masters
        self.mixed = any(m is not p for m, p in zip(self.masters, self.model_params))
        self.inner = torch.optim.AdamW(groups, **step_options(self.masters), **adamw_kwargs)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    @torch.no_grad()
    def step(self) -> None:
        """Upcast the model's gradients into the masters, step them, write the weights back.

        A parameter's gradient is megatron DDP's ``main_grad`` (fp32) when it has one, else ``.grad``."""
        for p, m in zip(self.model_params, self.masters):
            g = getattr(p, "main_grad", None)
            if g is not None:
                m.grad = g if g.dtype == m.dtype else g.float()  # a view of the buffer: no copy
            elif m is not p:
                m.grad = None if p.grad is None else p.grad.detach().float()
        self.inner.step()
        if self.mixed:
            for p, m in zip(self.model_params, self.masters):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Masters := the model's weights (after weights are loaded into the model)."""
        for p, m in zip(self.model_params, self.masters):
            if m is not p:
                m.copy_(p)
