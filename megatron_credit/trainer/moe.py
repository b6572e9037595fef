"""What the trainer adds around a mixture-of-experts actor: the router's statistics and the weight of
megatron's auxiliary losses in the actor's backward.

* :class:`RouterMonitor` hooks every ``TopKRouter`` of this rank's pipeline stage. In a training forward it
  counts the tokens each expert was routed to (per layer; a tensor on the routers' device, added to in
  place, never copied to the host per router or micro-batch) and, after the update, reads the load-balancing
  loss megatron logged (``moe_utils``' layer-wise tracker: each micro-batch's loss over its coefficient).
  :meth:`RouterMonitor.statistics` returns them as ``sum:`` statistics that the trainer reduces over DP x CP
  like the loss's (layers of other pipeline stages summed in first), and :data:`MOE` turns them into
  ``moe/load_balance_loss`` (the mean over layers and micro-batches) and ``moe/expert_load_max_frac`` (the
  largest share of one layer's routed token slots that one expert got over the iteration; uniform routing
  is ``1 / num_experts``).
* :class:`RoutingReplay` (``moe.routing_replay``): each router's top-k goes through megatron's replay plug
  (``TopKRouter.router_replay``, the object ``topk_routing_with_score_function`` asks for the top-k, in
  megatron-core 0.16 and 0.19 alike). Ours is set per micro-batch to the experts the rollout engine routed
  each token to; the router's own scores are gathered at them, so the gate weights (and their gradient)
  stay the trainer's. ``rollout`` replays them, ``none`` keeps the router's own choice; both count
  ``moe/routing_agreement``, the share of (token, layer) pairs whose top-k set the trainer's router picks
  itself, over the behaviour pass (the weights that generated the samples, under ``sync``).
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

from megatron_credit.metrics.tables import MetricTable

PREFIX = "sum:moe/tokens/"


def _max_frac(v) -> dict[str, float]:
    layers: dict[str, dict[str, float]] = {}
    for key, x in v.items():
        if key.startswith(PREFIX):
            layer, expert = key[len(PREFIX):].split("/")
            layers.setdefault(layer, {})[expert] = float(x)
    fracs = [max(c.values()) / sum(c.values()) for c in layers.values() if sum(c.values()) > 0]
    return {"moe/expert_load_max_frac": max(fracs)} if fracs else {}


def _agreement(v) -> dict[str, float]:
    n = v.get("sum:moe/routing_tokens")
    if n is None or float(n) <= 0:  # no routing from the engine: no metric
        return {}
    return {"moe/routing_agreement": float(v["sum:moe/routing_agree"] / n)}


MOE = MetricTable(means={"moe/load_balance_loss": ("sum:moe/lb_loss", "sum:moe/lb_count")},
                  derived=(_max_frac, _agreement))
"""A mixture-of-experts actor's router metrics (:class:`RouterMonitor`)."""


def routers(model) -> list:
    """The ``TopKRouter`` modules of ``model`` (a pipeline stage), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouterMonitor:
    """Routed-token counts and the load-balancing loss of this stage's routers (see the module docstring)."""

    def __init__(self, model, *, num_layers: int, num_experts: int, pp_group, tp_group=None,
                 device: torch.device = torch.device("cpu")) -> None:
        """``tp_group``: under sequence parallelism, the TP group (each TP rank routes its own slice of the
        sequence, so the counts are summed over it); None otherwise (every TP rank routes every token).
        ``device``: the routers' (the actor's), where the counts accumulate: no host copy per router and
        micro-batch, one read when :meth:`statistics` is taken."""
        self.num_layers, self.num_experts, self.pp_group, self.tp_group = num_layers, num_experts, pp_group, tp_group
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for router in routers(model):
            router.register_forward_hook(self._count)

    def _count(self, router, _inputs, outputs) -> None:
        if router.training and torch.is_grad_enabled():  # the update's forwards, not the behaviour pass
            routing_map = outputs[1]  # [tokens, experts] bool: integer counts, exact in float64
            self.counts[router.layer_number - 1].add_(routing_map.detach().sum(dim=0).to(self.counts.device))

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
        counts = self.counts.to(device, copy=True)  # the reductions below must not touch the accumulator
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(counts, group=self.tp_group)  # megatron's loss is reduced over TP already
        packed = torch.cat([counts.flatten(),
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
def aux_loss_scale(factor: "float | torch.Tensor") -> Iterator[None]:
    """Within it, megatron's ``MoEAuxLossAutoScaler.set_loss_scale(s)`` (called by the schedule for each
    micro-batch) sets ``s * factor`` (see the module docstring). ``factor`` may be a 0-dim device tensor (the
    host never reads it): it is cast to ``s``'s dtype, as a Python float would be."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def scaled(scale: torch.Tensor) -> None:
        f = factor.to(scale.device, scale.dtype) if isinstance(factor, torch.Tensor) else factor
        original.__func__(scale * f)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(scaled)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = original


class _LayerReplay:
    """One router's replay plug: megatron calls ``get_replay_topk(scores, topk, num_groups, group_topk,
    compute_topk)`` where it would take the top-k of ``scores`` (``[tokens, experts]``)."""

    def __init__(self, owner: "RoutingReplay", layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.owner.target(self.layer)
        if target is None:
            return values, own
        if target.shape != own.shape:
            raise RuntimeError(f"routing replay: layer {self.layer + 1} routes {tuple(own.shape)} (tokens, top-k) "
                               f"but the rollout's routing has {tuple(target.shape)}")
        target = target.to(own.device)
        known = target[:, 0] >= 0
        if self.owner.counting:
            same = (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1) & known
            self.owner.count(same.sum(), known.sum())
        if not self.owner.replay:
            return values, own
        index = torch.where(known[:, None], target, own)
        return scores.gather(1, index), index


class RoutingReplay:
    """The rollout engine's routing in this stage's routers (see the module docstring).

    :meth:`set_microbatch` before each forward gives every router its tokens' experts (the micro-batch's
    ``routed_experts``, ``[b, s, layers, top_k]``, this CP rank's share) in the router's own token order:
    ``[s, b]`` flattened, and under sequence parallelism this TP rank's slice of ``s``. With full
    recompute the router runs again in the backward: the targets of each forward wait in a queue per
    layer and the recomputation takes them in order (micro-batches are recomputed in the order they ran).
    Tokens without routing (-1: the last sampled token, padding) keep the router's own choice."""

    def __init__(self, model, *, replay: bool, device: torch.device, tp_size: int = 1, tp_rank: int = 0,
                 sequence_parallel: bool = False, recompute: bool = False, tp_group=None, pp_group=None) -> None:
        self.replay, self.recompute = replay, recompute
        self.tp_size, self.tp_rank, self.sp = tp_size, tp_rank, sequence_parallel
        self.tp_group, self.pp_group = tp_group, pp_group
        self.counting = self.training = False
        # (token, layer) pairs whose top-k agrees, and those with routing: on the device, no host sync
        self.agreement = torch.zeros(2, dtype=torch.float64, device=device)
        self._current: dict[int, torch.Tensor] = {}
        self._queued: dict[int, list[torch.Tensor]] = {}
        self.layers = []
        for router in routers(model):
            layer = router.layer_number - 1
            router.router_replay = _LayerReplay(self, layer)
            self.layers.append(layer)

    def set_microbatch(self, routed: "torch.Tensor | None") -> None:
        """The targets of the next forward: ``routed`` ``[b, s, layers, top_k]`` or None (none)."""
        self._current = {}
        if routed is None:
            return
        x = routed.transpose(0, 1)  # [s, b, layers, top_k]: the router's token order
        if self.sp and self.tp_size > 1:
            chunk = x.shape[0] // self.tp_size
            x = x[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
        for layer in self.layers:
            self._current[layer] = x[:, :, layer].reshape(-1, x.shape[-1]).long()

    def target(self, layer: int) -> "torch.Tensor | None":
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward and self.recompute:  # full recompute: this layer's forward of the same micro-batch
            queue = self._queued.get(layer)
            return queue.pop(0) if queue else None
        current = self._current.get(layer)
        if self.recompute and self.training and not torch.is_grad_enabled() and current is not None:
            self._queued.setdefault(layer, []).append(current)  # inside the checkpoint: recomputed later
        return current

    def start(self, *, count: bool, training: bool) -> None:
        """Before a schedule: forget queued targets; ``count``: count the agreement in its forwards;
        ``training``: a forward-backward pass (its layers may be recomputed)."""
        self._queued, self._current, self.counting, self.training = {}, {}, count, training

    def count(self, agree: torch.Tensor, tokens: torch.Tensor) -> None:
        self.agreement += torch.stack([agree, tokens]).to(self.agreement.device, torch.float64)

    def statistics(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The agreement counted since the last call, summed over this pipeline's stages (and the TP ranks
        under sequence parallelism, which route different tokens); resets it. Collective over PP (and TP)."""
        v = self.agreement.to(device).clone()
        for group, on in ((self.pp_group, True), (self.tp_group, self.sp)):
            if on and group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(v, group=group)
        self.agreement.zero_()
        return {"sum:moe/routing_agree": v[0], "sum:moe/routing_tokens": v[1]}
