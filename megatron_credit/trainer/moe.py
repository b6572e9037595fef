"""What the trainer adds around a mixture-of-experts actor: the router's statistics and the weight of
megatron's auxiliary losses in the actor's backward.

* :class:`RouterMonitor` hooks every ``TopKRouter`` of this rank's pipeline stage. In a training forward it
  counts the tokens each expert was routed to (per layer) and, after the update, reads the load-balancing
  loss megatron logged (``moe_utils``' layer-wise tracker: each micro-batch's loss over its coefficient).
  :meth:`RouterMonitor.statistics` returns them as ``sum:`` statistics that the trainer reduces over DP x CP
  like the loss's (layers of other pipeline stages summed in first), and :data:`MOE` turns them into
  ``moe/load_balance_loss`` (the mean over layers and micro-batches) and ``moe/expert_load_max_frac`` (the
  largest share of one layer's routed token slots that one expert got over the iteration; uniform routing
  is ``1 / num_experts``). The router is also where routing replay plugs in: a forward hook that reads
  the routing map here is the place that would substitute the rollout engine's.
* :func:`aux_loss_scale`: megatron attaches the aux losses to the activations (``MoEAuxLossAutoScaler``)
  and, with ``calculate_per_token_loss``, multiplies each micro-batch's loss by its token count and sets the
  backward scale to 1, expecting ``finalize_model_grads`` to divide by the global token count. The trainer's
  loss contract (``trainer/actor.py``) divides by nothing there, so the scale is ``1 / N``, N the router
  tokens of the mini-batch over DP x CP: the aux loss enters the gradient as its token-weighted mean.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_credit.algorithm.metric_tables import MetricTable

PREFIX = "sum:moe/tokens/"


def _max_frac(v) -> dict[str, float]:
    layers: dict[str, dict[str, float]] = {}
    for key, x in v.items():
        if key.startswith(PREFIX):
            layer, expert = key[len(PREFIX):].split("/")
            layers.setdefault(layer, {})[expert] = float(x)
    fracs = [max(c.values()) / sum(c.values()) for c in layers.values() if sum(c.values()) > 0]
    return {"moe/expert_load_max_frac": max(fracs)} if fracs else {}


MOE = MetricTable(means={"moe/load_balance_loss": ("sum:moe/lb_loss", "sum:moe/lb_count")}, derived=(_max_frac,))
"""A mixture-of-experts actor's router metrics (:class:`RouterMonitor`)."""


def routers(model) -> list:
    """The ``TopKRouter`` modules of ``model`` (a pipeline stage), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterMonitor:
    """Routed-token counts and the load-balancing loss of this stage's routers (see the module docstring)."""

    def __init__(self, model, *, num_layers: int, num_experts: int, pp_group) -> None:
        self.num_layers, self.num_experts, self.pp_group = num_layers, num_experts, pp_group
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        for router in routers(model):
            router.register_forward_hook(self._count)

    def _count(self, router, _inputs, outputs) -> None:
        if router.training and torch.is_grad_enabled():  # the update's forwards, not the behaviour pass
            routing_map = outputs[1]
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0).detach().to("cpu", torch.float64)

    def statistics(self, device: torch.device, *, reduce: bool = True) -> dict[str, torch.Tensor]:
        """The iteration's ``sum:`` statistics (every stage's layers, summed over PP), and a reset; with
        ``reduce=False`` only the reset (no collective)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        lb = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if not reduce:
            self.counts.zero_()
            if lb is not None:
                lb["values"].zero_()
            return {}
        values = lb["values"].detach().to(device, torch.float64) if lb is not None else None
        packed = torch.cat([self.counts.to(device).flatten(),
                            values if values is not None else torch.zeros(self.num_layers, device=device,
                                                                          dtype=torch.float64)])
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(packed, group=self.pp_group)  # each stage fills its own layers
        counts = packed[: self.counts.numel()].view(self.num_layers, self.num_experts)
        out = {f"{PREFIX}{i}/{e}": counts[i, e] for i in range(self.num_layers) for e in range(self.num_experts)}
        if values is not None:
            lb_values = packed[self.counts.numel():]
            routed = (counts.sum(dim=1) > 0).sum()  # layers that routed tokens this iteration
            out.update({"sum:moe/lb_loss": lb_values.sum(), "sum:moe/lb_count": routed.to(torch.float64)})
            lb["values"].zero_()
        self.counts.zero_()
        return out


@contextlib.contextmanager
def aux_loss_scale(factor: float) -> Iterator[None]:
    """Within it, megatron's ``MoEAuxLossAutoScaler.set_loss_scale(s)`` (called by the schedule for each
    micro-batch) sets ``s * factor`` (see the module docstring)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def scaled(scale: torch.Tensor) -> None:
        original.__func__(scale * factor)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(scaled)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = original
