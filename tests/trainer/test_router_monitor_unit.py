"""The router monitor's expert counts (``trainer/moe.py``), without a model: each training forward adds its
routing map's per-expert token counts to one float64 tensor on the routers' device, in place (no host copy
per router and micro-batch); :meth:`RouterMonitor.statistics` reads them once, as ``sum:moe/tokens/`` values
equal to a loop's, and resets them. The counts inside the actor, under every layout, are
``tests/trainer/test_routing_replay.py`` and ``tests/trainer/test_moe_expert_parallel.py``."""
from __future__ import annotations

import types

import torch

from megatron_credit.trainer.moe import PREFIX, RouterMonitor


def test_counts_accumulate_in_place_and_read_once_like_a_loop():
    layers, experts = 3, 5
    monitor = RouterMonitor(torch.nn.Module(), num_layers=layers, num_experts=experts, pp_group=None,
                            device=torch.device("cpu"))
    counts, ptr = monitor.counts, monitor.counts.data_ptr()
    g = torch.Generator().manual_seed(0)
    want = torch.zeros(layers, experts, dtype=torch.float64)
    for micro in range(4):
        for layer in range(1, layers + 1):
            routing_map = torch.rand(7 + micro, experts, generator=g) < 0.4
            router = types.SimpleNamespace(training=True, layer_number=layer)
            monitor._count(router, (), (None, routing_map))
            for t in range(routing_map.shape[0]):
                for e in range(experts):
                    want[layer - 1, e] += bool(routing_map[t, e])
    with torch.no_grad():  # the behaviour pass: not counted
        monitor._count(types.SimpleNamespace(training=True, layer_number=1), (), (None, torch.ones(9, experts) > 0))
    monitor._count(types.SimpleNamespace(training=False, layer_number=1), (), (None, torch.ones(9, experts) > 0))
    assert monitor.counts is counts and counts.data_ptr() == ptr and counts.dtype == torch.float64
    assert torch.equal(counts, want)
    stats = monitor.statistics(torch.device("cpu"))
    assert {k: float(v) for k, v in stats.items() if k.startswith(PREFIX)} == \
        {f"{PREFIX}{i}/{e}": float(want[i, e]) for i in range(layers) for e in range(experts)}
    assert monitor.counts is counts and not counts.any()  # reset in place, the statistics kept
    assert float(sum(v for k, v in stats.items() if k.startswith(PREFIX))) == float(want.sum()) > 0
