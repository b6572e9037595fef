"""The routing replay's plug in megatron's router (``trainer/moe.py``), without a model: which experts it
returns, the gate scores it gathers, the agreement it counts, the token order of its targets under
sequence parallelism, and the queue that full recompute's second forward reads in the backward. The
replay inside the actor, under every layout, is ``tests/trainer/test_routing_replay.py``."""
from __future__ import annotations

import torch

from megatron_credit.trainer.moe import RoutingReplay, _LayerReplay


def _replay(**kw) -> RoutingReplay:
    r = RoutingReplay(torch.nn.Module(), device=torch.device("cpu"), **{"replay": True, **kw})
    r.layers = [0, 1]  # a model with two MoE layers
    return r


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_the_plug_replays_known_tokens_gathers_their_scores_and_counts_agreement_like_a_loop():
    g = torch.Generator().manual_seed(0)
    n, experts, k = 40, 6, 2
    scores = torch.randn(n, experts, generator=g, dtype=torch.float64)
    target = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    own = torch.topk(scores, k, dim=1).indices
    target[::3] = own[::3].flip(-1)  # a third agree (in another order: a set is compared)
    target[::7] = -1  # no routing from the engine
    for replay in (True, False):
        r = _replay(replay=replay)
        r.start(count=True, training=False)
        r.set_microbatch(torch.stack([target, target], dim=1)[None])  # [b=1, s=n, layers=2, k]
        values, index = _LayerReplay(r, 0).get_replay_topk(scores, k, None, None, _topk)
        agree = tokens = 0
        for i in range(n):
            known = bool(target[i, 0] >= 0)
            want = target[i] if replay and known else own[i]
            assert index[i].tolist() == want.tolist()
            assert values[i].tolist() == [scores[i, e].item() for e in want]
            tokens += known
            agree += known and set(own[i].tolist()) == set(target[i].tolist())
        assert r.agreement.tolist() == [agree, tokens] and 0 < agree < tokens


def test_without_targets_the_router_chooses_and_nothing_is_counted():
    scores = torch.randn(5, 4)
    r = _replay()
    r.start(count=True, training=False)
    r.set_microbatch(None)
    values, index = _LayerReplay(r, 0).get_replay_topk(scores, 2, None, None, _topk)
    assert torch.equal(index, torch.topk(scores, 2, dim=1).indices) and r.agreement.tolist() == [0, 0]


def test_targets_follow_the_routers_token_order_and_the_tp_ranks_slice_under_sequence_parallelism():
    b, s, layers, k = 2, 6, 2, 2
    routed = torch.arange(b * s * layers * k, dtype=torch.int16).view(b, s, layers, k)
    for tp_rank in (0, 1):
        r = _replay(tp_size=2, tp_rank=tp_rank, sequence_parallel=True)
        r.start(count=False, training=False)
        r.set_microbatch(routed)
        for layer in (0, 1):
            # the router's tokens: [s / tp, b] of this TP rank, s-major
            want = [routed[j, i, layer].tolist() for i in range(tp_rank * 3, tp_rank * 3 + 3) for j in range(b)]
            assert r.target(layer).tolist() == want


class _Recompute(torch.autograd.Function):
    """A layer under full recompute: its forward asks for the targets without grad (a Function's forward
    runs so, as megatron's checkpoint runs the layer), its backward again."""

    @staticmethod
    def forward(ctx, x, replay, seen):
        ctx.replay, ctx.seen = replay, seen
        seen.append(("forward", replay.target(0).tolist()))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(("backward", ctx.replay.target(0).tolist()))
        return grad * 2, None, None


def test_full_recompute_reads_each_micro_batchs_targets_again_in_the_backward_in_order():
    r = _replay(recompute=True)
    r.start(count=False, training=True)
    seen, outs = [], []
    x = torch.ones(1, requires_grad=True)
    for mb in range(2):  # two micro-batches forward, then both backward (1F1B's warm-up)
        r.set_microbatch(torch.full((1, 1, 2, 2), mb, dtype=torch.int16))
        outs.append(_Recompute.apply(x, r, seen))
    r.set_microbatch(None)  # what the schedule holds now is irrelevant to the recomputation
    for out in outs:
        out.backward()
    assert seen == [("forward", [[0, 0]]), ("forward", [[1, 1]]), ("backward", [[0, 0]]), ("backward", [[1, 1]])]
    assert r._queued == {0: []}


def test_a_forward_only_pass_queues_nothing():
    r = _replay(recompute=True)
    r.start(count=False, training=False)
    r.set_microbatch(torch.zeros((1, 1, 2, 2), dtype=torch.int16))
    with torch.no_grad():
        r.target(0)
    assert r._queued == {}
