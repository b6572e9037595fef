"""CompPO's gate controls (fixed / shuffle / position) and critics against float64 loop references."""
import functools
import json
import math

import pytest
import torch

from megatron_credit.credit.gates import PositionGateSchedule, fixed_gates, relative_position_bins, shuffle_gates
from megatron_credit.models.critic import (StandardCritic, TransportAlignedCritic, average_ranks, build_critic,
                                           critic_diagnostics, critic_parameter_count)
from tests.support.distributed_harness import module_pool


def make_gates(b, t, seed, *, left_pad=True):
    """Random gates in (0, 1) and a mask of whole responses of random length, some left-padded, some right,
    one empty row and one of a single token."""
    g = torch.Generator().manual_seed(seed)
    kappa = torch.rand(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = [0, 1][i] if i < 2 else int(torch.randint(2, t + 1, (1,), generator=g))
        start = int(torch.randint(0, t - n + 1, (1,), generator=g)) if left_pad else 0
        mask[i, start:start + n] = True
    return kappa.float(), mask


# --- fixed and shuffle ------------------------------------------------------------------------------------


def test_fixed_gates_value_on_valid_zero_elsewhere():
    _, mask = make_gates(5, 11, 0)
    out = fixed_gates(mask, 0.61)
    assert out.dtype == torch.float32
    assert torch.equal(out[mask], torch.full((int(mask.sum()),), 0.61))
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(fixed_gates(mask, 0.0), torch.zeros(mask.shape))  # the envelope's ends are allowed
    assert torch.equal(fixed_gates(mask, 1.0), mask.float())
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match="fixed_gate"):
            fixed_gates(mask, bad)


def test_shuffle_keeps_the_multiset_and_zeros_masked():
    kappa, mask = make_gates(6, 13, 1)
    kappa[~mask] = 7.0  # junk under the mask must not leak into valid positions
    out = shuffle_gates(kappa, mask, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.sort(out[mask]).values, torch.sort(kappa[mask]).values)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    assert not torch.equal(out, torch.where(mask, kappa, 0.0))  # it did permute
    again = shuffle_gates(kappa, mask, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out, again)  # the seed fixes the shuffle
    with pytest.raises(ValueError, match="same shape"):
        shuffle_gates(kappa, mask[:, :-1], generator=torch.Generator())


def test_shuffle_mixes_rows():
    """Row i's gates lie in [i, i + 0.5): after one global permutation, rows hold other rows' gates."""
    b, t = 4, 16
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :5] = False
    noise = torch.rand(b, t, generator=torch.Generator().manual_seed(0))
    kappa = torch.arange(b, dtype=torch.float32)[:, None] + 0.5 * noise
    out = shuffle_gates(kappa, mask, generator=torch.Generator().manual_seed(1))
    origin = torch.floor(out).long()  # the row each gate came from
    foreign = (origin != torch.arange(b)[:, None]) & mask
    assert foreign.any(dim=1).all()  # every row received gates from other rows
    # over many draws, a position receives each valid gate equally often (a uniform global permutation)
    small = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.4, 0.5]])
    small_mask = torch.tensor([[True, True, False], [True, True, True]])
    gen = torch.Generator().manual_seed(2)
    draws = 5000
    hits = torch.zeros(5)
    for _ in range(draws):
        v = shuffle_gates(small, small_mask, generator=gen)[0, 0]
        hits[int(round(float(v) * 10)) - 1] += 1
    assert torch.allclose(hits / draws, torch.full((5,), 0.2), atol=0.03)


# --- position schedule -----------------------------------------------------------------------------------


def position_reference(batches, bins):
    """Bin means by a python loop: t counts the row's earlier valid tokens, bin = floor(bins t / T_b)."""
    sums, counts = [0.0] * bins, [0] * bins
    for kappa, mask in batches:
        for i in range(mask.shape[0]):
            cols = [j for j in range(mask.shape[1]) if mask[i, j]]
            for t, j in enumerate(cols):
                k = (bins * t) // len(cols)
                sums[k] += float(kappa[i, j])
                counts[k] += 1
    overall = sum(sums) / sum(counts)
    return [sums[k] / counts[k] if counts[k] else overall for k in range(bins)]


def test_relative_position_bins_loop():
    _, mask = make_gates(7, 29, 4)
    got = relative_position_bins(mask, 20)
    for i in range(7):
        cols = [j for j in range(29) if mask[i, j]]
        want = torch.full((29,), -1, dtype=torch.long)
        for t, j in enumerate(cols):
            want[j] = math.floor(20 * t / len(cols))
        assert torch.equal(got[i], want)


@pytest.mark.parametrize("bins", [20, 3, 1])
def test_position_schedule_is_the_bin_means(bins):
    batches = [make_gates(6, 37, seed) for seed in (5, 6, 7)]
    sched = PositionGateSchedule(bins)
    for kappa, mask in batches:
        sched.collect(kappa, mask)
    assert not sched.frozen
    sched.freeze()
    assert sched.frozen
    means = position_reference(batches, bins)
    _, mask = make_gates(9, 41, 8, left_pad=True)
    out = sched.gates(mask)
    assert out.dtype == torch.float32
    for i in range(mask.shape[0]):
        cols = [j for j in range(mask.shape[1]) if mask[i, j]]
        for t, j in enumerate(cols):
            assert float(out[i, j]) == pytest.approx(means[(bins * t) // len(cols)], abs=1e-6)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum())))
    # piecewise constant in t/T: along a long row, `bins` contiguous runs, each exactly its bin's mean
    long_row = torch.ones(1, 400, dtype=torch.bool)
    vals = sched.gates(long_row)[0]
    bin_of = relative_position_bins(long_row, bins)[0]
    assert torch.equal(torch.unique_consecutive(bin_of), torch.arange(bins))
    assert torch.equal(vals, torch.tensor(means, dtype=torch.float64).float()[bin_of])


def test_position_schedule_empty_bin_takes_overall_mean():
    kappa = torch.tensor([[0.2, 0.5, 0.8, 0.0]])
    mask = torch.tensor([[True, True, True, False]])  # T = 3: bins 0, 6 and 13 of 20
    sched = PositionGateSchedule(20)
    sched.collect(kappa, mask)
    sched.freeze()
    out = sched.gates(torch.ones(1, 20, dtype=torch.bool))[0]  # T = 20: bin k at t = k
    want = torch.full((20,), 0.5)
    want[0], want[6], want[13] = 0.2, 0.5, 0.8
    assert torch.allclose(out, want, atol=1e-7)


def test_position_schedule_state_dict_and_misuse():
    sched = PositionGateSchedule(4)
    with pytest.raises(RuntimeError, match="freeze"):
        sched.gates(torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="no gates"):
        sched.freeze()
    kappa, mask = make_gates(4, 9, 9)
    sched.collect(kappa, mask)
    half = PositionGateSchedule(4)
    half.load_state_dict(json.loads(json.dumps(sched.state_dict())))  # plain lists and floats
    assert not half.frozen
    sched.freeze()
    half.freeze()
    restored = PositionGateSchedule(4)
    restored.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert restored.frozen
    probe = torch.ones(2, 11, dtype=torch.bool)
    assert torch.equal(restored.gates(probe), sched.gates(probe))
    assert torch.equal(half.gates(probe), sched.gates(probe))
    with pytest.raises(RuntimeError, match="after freeze"):
        sched.collect(kappa, mask)
    with pytest.raises(ValueError, match="same shape"):
        PositionGateSchedule(4).collect(kappa, mask[:-1])
    with pytest.raises(ValueError, match="position_bins"):
        PositionGateSchedule(5).load_state_dict(sched.state_dict())
    with pytest.raises(ValueError, match="position_bins"):
        PositionGateSchedule(0)


pool = module_pool(2)


def _collect_shard(batches, bins):
    import torch.distributed as dist

    rank = dist.get_rank()
    sched = PositionGateSchedule(bins)
    for kappa, mask in batches:
        half = kappa.shape[0] // 2
        rows = slice(0, half) if rank == 0 else slice(half, None)
        sched.collect(kappa[rows], mask[rows], group=dist.group.WORLD)
    sched.freeze()
    return sched.state_dict()


@pytest.mark.dist
def test_position_schedule_dp_allreduce_equals_single_process(pool):
    batches = [make_gates(8, 23, seed) for seed in (10, 11)]
    single = PositionGateSchedule(20)
    for kappa, mask in batches:
        single.collect(kappa, mask)
    single.freeze()
    states = pool.run(_collect_shard, batches, 20)
    assert states[0] == states[1]  # every rank holds the same schedule
    for key in ("sum", "count", "means"):
        assert torch.allclose(torch.tensor(states[0][key], dtype=torch.float64),
                              torch.tensor(single.state_dict()[key], dtype=torch.float64), rtol=0, atol=1e-12)


# --- critics ----------------------------------------------------------------------------------------------


def make_critic_inputs(*, b=2, s=5, big_s=9, h=8, k=3, n_layers=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(b, s, h, generator=g, dtype=dtype) for _ in range(n_layers)]
    history = torch.randn(b, big_s, h, generator=g, dtype=dtype)
    topk_idx = torch.randint(0, big_s, (b, s, k), generator=g)
    topk_w = torch.rand(b, s, k, generator=g, dtype=dtype)
    topk_w[0, 0, 1:] = 0.0  # a query with one real key
    topk_w[1, 2, :] = 0.0   # a query with no key at all
    kappa = torch.rand(b, s, generator=g, dtype=dtype)
    return layers, history, topk_idx, topk_w, kappa


def randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.7)
    return module


def tac_reference(c, layers, history, topk_idx, topk_w, kappa):
    """TAC by loops in float64, from the module docstring's equations."""
    b, s, _ = layers[0].shape
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    alpha = torch.softmax(c.alpha.double(), 0)
    d = c.proj_dim
    out = torch.zeros(b, s, dtype=torch.float64)
    for bi in range(b):
        for t in range(s):
            z = sum(alpha[l] * layers[l][bi, t] for l in range(len(layers)))
            q = c.w_q.weight.double() @ z
            num, den = torch.zeros(d, dtype=torch.float64), 0.0
            for j in range(topk_idx.shape[2]):
                w = float(topk_w[bi, t, j])
                if w == 0.0:
                    continue
                hi = history[bi, int(topk_idx[bi, t, j])]
                key, val = c.w_k.weight.double() @ hi, c.w_u.weight.double() @ hi
                r = sig(float(q @ key) / math.sqrt(d))
                num += w * r * val
                den += w * r
            summary = num / (den + c.eps)
            f = torch.tanh(c.local_in.weight.double() @ z + c.local_in.bias.double())
            v_local = float(c.local_out.weight.double()[0] @ f + c.local_out.bias.double()[0])
            hr = torch.tanh(c.routed_in.weight.double() @ torch.cat([summary, f]) + c.routed_in.bias.double())
            v_routed = float(c.routed_out.weight.double()[0] @ hr + c.routed_out.bias.double()[0])
            g = float(kappa[bi, t])
            out[bi, t] = min(max((1 - g) * v_local + g * v_routed, -c.value_clamp), c.value_clamp)
    return out


@pytest.mark.parametrize("clamp,dense", [(1.0, True), (50.0, False)])
def test_tac_matches_loop_reference_float64(clamp, dense):
    inputs = make_critic_inputs()
    critic = randomize(TransportAlignedCritic(8, num_layers=3, proj_dim=4, value_clamp=clamp, dtype=torch.float64), 1)
    got = critic(*inputs)
    with torch.no_grad():
        want = tac_reference(critic, *inputs)
    assert got.dtype == torch.float32
    if clamp == 1.0:  # clamped and free values are both checked
        assert (want.abs() < 1.0).any() and (want.abs() == 1.0).any()
    # the module computes in float64 and rounds once to float32 at the end
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6)
    # the same in float64 before the final cast: the pooled summary (dense or gathered) equals the loop's
    q = critic.w_q(critic.fuse(inputs[0]))
    summary = critic.history_summary(q, inputs[1], inputs[2], inputs[3], dense=dense)
    assert summary.dtype == torch.float64
    layers, history, topk_idx, topk_w, _ = inputs
    with torch.no_grad():
        for bi in range(summary.shape[0]):
            for t in range(summary.shape[1]):
                num, den = torch.zeros(4, dtype=torch.float64), 0.0
                for j in range(topk_idx.shape[2]):
                    hi = history[bi, int(topk_idx[bi, t, j])]
                    rel = torch.sigmoid(q[bi, t] @ (critic.w_k.weight @ hi) / 2.0)  # sqrt(proj_dim) = 2
                    num += topk_w[bi, t, j] * rel * (critic.w_u.weight @ hi)
                    den += float(topk_w[bi, t, j] * rel)
                assert torch.allclose(summary[bi, t], num / (den + critic.eps), rtol=1e-12, atol=1e-14)
    assert torch.equal(summary[1, 2], torch.zeros(4, dtype=torch.float64))  # no key: an empty summary


def test_tac_gathers_like_advanced_indexing_bit_for_bit():
    """The gathered pooling looks its top-K rows up as an embedding: values and every parameter's gradient
    equal those of advanced indexing ``keys[rows, idx]`` exactly (keys shared by many queries, padding
    slots). One thread: advanced indexing's backward adds with atomics across threads."""
    def by_advanced_indexing(c, q, history, topk_idx, topk_w):
        keys, vals = c.w_k(history), c.w_u(history)
        idx = torch.where(topk_w > 0, topk_idx, torch.zeros_like(topk_idx))
        rows = torch.arange(idx.shape[0]).view(-1, 1, 1)
        rel = torch.sigmoid(torch.einsum("bsd,bskd->bsk", q, keys[rows, idx]) / math.sqrt(c.proj_dim))
        a = topk_w * rel
        return torch.einsum("bsk,bskd->bsd", a, vals[rows, idx]) / (a.sum(-1, keepdim=True) + c.eps)

    g = torch.Generator().manual_seed(7)
    b, s, h, k = 3, 40, 16, 8
    history, q = torch.randn(b, s, h, generator=g), torch.randn(b, s, 4, generator=g)
    topk_idx = torch.randint(0, s, (b, s, k), generator=g)
    topk_idx[:, :, :3] = torch.randint(0, 3, (b, s, 3), generator=g)  # a few keys read by every query
    topk_w = torch.rand(b, s, k, generator=g)
    topk_w[:, :, -2:] = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = []
        for fn in (functools.partial(TransportAlignedCritic.history_summary, dense=False), by_advanced_indexing):
            critic = randomize(TransportAlignedCritic(h, num_layers=2, proj_dim=4), 5)
            qq = q.clone().requires_grad_()
            out = fn(critic, qq, history, topk_idx, topk_w)
            out.pow(2).sum().backward()
            outs.append([out.detach(), qq.grad, critic.w_k.weight.grad, critic.w_u.weight.grad])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    assert outs[0][2].abs().sum() > 0 and outs[0][3].abs().sum() > 0


def test_tac_dense_pooling_equals_the_gathered_one_and_is_taken_for_short_histories():
    """Dense and gathered pooling: the same summary and the same gradients of the query and of both
    projections, in float64 to rounding, with keys read by many queries, keys repeated within a query's
    slots and padding slots. The default takes the dense one while ``S <= DENSE_KEYS_PER_SLOT * K``."""
    from megatron_credit.models.critic import DENSE_KEYS_PER_SLOT

    g = torch.Generator().manual_seed(11)
    b, s, h, k = 3, 40, 16, 8
    history = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    q = torch.randn(b, s, 4, generator=g, dtype=torch.float64)
    topk_idx = torch.randint(0, s, (b, s, k), generator=g)
    topk_idx[:, :, :3] = torch.randint(0, 3, (b, s, 3), generator=g)  # a few keys read by every query
    topk_idx[:, :, 4] = topk_idx[:, :, 5]  # a key in two slots of a query: both count
    topk_w = torch.rand(b, s, k, generator=g, dtype=torch.float64)
    topk_w[:, :, -2:] = 0.0
    topk_idx[:, :, -1] = -5  # a padding slot's index is ignored on both paths
    outs = {}
    for dense in (True, False, None):
        critic = randomize(TransportAlignedCritic(h, num_layers=2, proj_dim=4, dtype=torch.float64), 5)
        qq = q.clone().requires_grad_()
        out = critic.history_summary(qq, history, topk_idx, topk_w, dense=dense)
        out.pow(2).sum().backward()
        outs[dense] = [out.detach(), qq.grad, critic.w_k.weight.grad, critic.w_u.weight.grad]
    for x, y in zip(outs[True], outs[False]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    assert all(x.abs().sum() > 0 for x in outs[True])
    assert s <= DENSE_KEYS_PER_SLOT * k and all(torch.equal(x, y) for x, y in zip(outs[None], outs[True]))
    # past the rule's bound (one slot, more keys than DENSE_KEYS_PER_SLOT): the gathered pooling
    long = torch.randn(1, DENSE_KEYS_PER_SLOT + 1, h, generator=g, dtype=torch.float64)
    idx1, w1 = torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, 1, dtype=torch.float64)
    critic = randomize(TransportAlignedCritic(h, num_layers=2, proj_dim=4, dtype=torch.float64), 5)
    by = {d: critic.history_summary(q[:1, :2], long, idx1, w1, dense=d) for d in (None, False, True)}
    assert torch.equal(by[None], by[False])
    torch.testing.assert_close(by[True], by[False], rtol=1e-12, atol=1e-14)


def test_tac_padding_slots_are_ignored():
    layers, history, topk_idx, topk_w, kappa = make_critic_inputs(k=4, seed=2)
    topk_w[:, :, 3] = 0.0
    critic = randomize(TransportAlignedCritic(8, num_layers=3, proj_dim=4, value_clamp=50.0, dtype=torch.float64), 3)
    base = critic(layers, history, topk_idx, topk_w, kappa)
    junk_idx = topk_idx.clone()
    junk_idx[:, :, 3] = -1  # a padding slot's index may be anything, even out of range
    junk_idx[0, 0, 1:] = 10_000
    assert torch.equal(critic(layers, history, junk_idx, topk_w, kappa), base)
    dropped = critic(layers, history, topk_idx[:, :, :3], topk_w[:, :, :3], kappa)
    assert torch.allclose(dropped, base, rtol=0, atol=1e-6)


def test_tac_zero_init_and_gradients_flow():
    layers, history, topk_idx, topk_w, kappa = make_critic_inputs(dtype=torch.float32, seed=4)
    layers = [x.requires_grad_() for x in layers]
    history.requires_grad_()
    critic = TransportAlignedCritic(8, num_layers=3, proj_dim=4)
    v = critic(layers, history, topk_idx, topk_w, kappa)
    assert torch.equal(v, torch.zeros_like(v))  # V == 0 exactly at init
    target = torch.linspace(-0.9, 0.9, v.numel()).view_as(v)
    ((v - target) ** 2).mean().backward()
    for name in ("local_out.weight", "local_out.bias", "routed_out.weight", "routed_out.bias"):
        assert dict(critic.named_parameters())[name].grad.abs().sum() > 0, name
    assert all(x.grad is None for x in layers) and history.grad is None  # actor features are detached
    # once the output layers moved, the gradient reaches every parameter
    with torch.no_grad():
        for p in critic.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    critic.zero_grad()
    v = critic(layers, history, topk_idx, topk_w, kappa)
    ((v - target) ** 2).mean().backward()
    for name, p in critic.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_standard_critic_uses_the_final_hidden_state_only():
    layers, history, topk_idx, topk_w, kappa = make_critic_inputs(dtype=torch.float32, seed=5)
    critic = StandardCritic(8, value_clamp=0.3)
    v = critic(layers, history, topk_idx, topk_w, kappa)
    assert torch.equal(v, torch.zeros_like(v))
    v.sum().backward()
    assert critic.head.weight.grad.abs().sum() > 0
    randomize(critic, 6)
    v = critic(layers, history, topk_idx, topk_w, kappa)
    want = (layers[-1].double() @ critic.head.weight.double()[0] + critic.head.bias.double()[0]).clamp(-0.3, 0.3)
    assert torch.allclose(v.double(), want, atol=1e-6)
    other = [torch.randn_like(x) for x in layers[:-1]] + [layers[-1]]
    assert torch.equal(critic(other, None, None, None, kappa), v)


def test_tac_accepts_bf16_features_and_checks_shapes():
    layers, history, topk_idx, topk_w, kappa = make_critic_inputs(dtype=torch.bfloat16, seed=7)
    critic = randomize(TransportAlignedCritic(8, num_layers=3, proj_dim=4), 8)
    v = critic(layers, history, topk_idx, topk_w, kappa)
    assert v.dtype == torch.float32 and v.shape == (2, 5) and (v.abs() <= 1.0).all()
    with pytest.raises(ValueError, match="critic_layers=3"):
        critic(layers[:2], history, topk_idx, topk_w, kappa)
    with pytest.raises(ValueError, match="history"):
        critic(layers, history[:, :4], topk_idx, topk_w, kappa)
    with pytest.raises(ValueError, match="critic="):
        build_critic("mlp", 8)


@pytest.mark.parametrize("h,layers,d", [(8, 3, 4), (16, 1, 8), (24, 4, 64)])
def test_parameter_count_matches_the_module(h, layers, d):
    tac = build_critic("tac", h, num_layers=layers, proj_dim=d)
    count = critic_parameter_count(h, kind="tac", num_layers=layers, proj_dim=d)
    assert count == sum(p.numel() for p in tac.parameters())
    std = build_critic("standard", h)
    assert critic_parameter_count(h, kind="standard") == sum(p.numel() for p in std.parameters())


def qwen3_4b_parameters():
    """Qwen3-4B from its config: hidden 2560, 36 layers, 32 heads / 8 KV heads of dim 128, SwiGLU 9728,
    vocab 151936, tied embeddings, no biases, q/k RMSNorm per head."""
    hidden, n_layers, heads, kv_heads, head_dim, inter, vocab = 2560, 36, 32, 8, 128, 9728, 151936
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden + 2 * head_dim
    mlp = 3 * hidden * inter
    norms = 2 * hidden
    return vocab * hidden + n_layers * (attn + mlp + norms) + hidden


def test_critic_is_under_half_a_percent_of_qwen3_4b():
    actor = qwen3_4b_parameters()
    assert actor == 4_022_468_096  # the published "4.0B" (Qwen3-4B model card: 4.0B, 3.6B non-embedding)
    tac = critic_parameter_count(2560, kind="tac", num_layers=4, proj_dim=64)
    assert tac < 0.005 * actor
    assert tac / actor < 0.0002  # measured: 663,814 parameters, 0.0165% of the actor


# --- diagnostics ------------------------------------------------------------------------------------------


def spearman_reference(x, y):
    """Ranks by counting (ties: mean rank), then Pearson's formula in python floats."""
    def ranks(v):
        return [sum(1 for w in v if w < a) + (sum(1 for w in v if w == a) + 1) / 2 for a in v]
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def test_average_ranks_with_ties():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (40,), generator=g).double()
    got = average_ranks(x)
    xs = x.tolist()
    want = [sum(1 for w in xs if w < a) + (sum(1 for w in xs if w == a) + 1) / 2 for a in xs]
    assert got.tolist() == want


def test_critic_diagnostics_against_references():
    g = torch.Generator().manual_seed(1)
    b, t = 4, 15
    returns = torch.randint(-3, 4, (b, t), generator=g).float() / 3  # ties in the targets
    values = (0.6 * returns + 0.4 * torch.randn(b, t, generator=g)).clamp(-1, 1)
    values[0, :3] = 1.0
    mask = torch.rand(b, t, generator=g) < 0.8
    values[~mask], returns[~mask] = 99.0, -99.0  # masked junk must not count
    d = critic_diagnostics(values, returns, mask, value_clamp=1.0)
    v, r = values[mask].double().tolist(), returns[mask].double().tolist()
    n = len(v)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: mean([(a - mean(xs)) ** 2 for a in xs])  # noqa: E731
    assert float(d["explained_var"]) == pytest.approx(1 - var([a - b for a, b in zip(r, v)]) / var(r), abs=1e-12)
    assert float(d["spearman"]) == pytest.approx(spearman_reference(v, r), abs=1e-12)
    assert float(d["value_mae"]) == pytest.approx(mean([abs(a - b) for a, b in zip(v, r)]), abs=1e-12)
    assert float(d["clamp_frac"]) == pytest.approx(sum(abs(a) >= 1 - 1e-6 for a in v) / n, abs=1e-15)
    assert all(x.dtype == torch.float64 and not x.requires_grad and x.dim() == 0 for x in d.values())
    # degenerate inputs: constant targets, no tokens
    flat = critic_diagnostics(values, torch.zeros_like(returns), mask, value_clamp=1.0)
    assert math.isnan(float(flat["explained_var"])) and math.isnan(float(flat["spearman"]))
    empty = critic_diagnostics(values, returns, torch.zeros_like(mask), value_clamp=1.0)
    assert all(math.isnan(float(x)) for x in empty.values())


# ---------------------------------------------------------------- gate controls: mutation killers
def test_gate_controls_are_float32_whatever_the_default_dtype():
    # The controls' gates enter Comp-GAE next to float32 gates from the actor: a float64 default dtype (a
    # user's set_default_dtype) must not make them float64.
    mask = torch.tensor([[True, True, False], [True, False, False]])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = fixed_gates(mask, 0.61)
        s = PositionGateSchedule(bins=2)
        s.collect(torch.tensor([[0.2, 0.4, 0.0], [0.6, 0.0, 0.0]], dtype=torch.float32), mask)
        s.freeze()
        p = s.gates(mask)
    finally:
        torch.set_default_dtype(previous)
    assert g.dtype == torch.float32 and p.dtype == torch.float32
    assert g.tolist() == [[pytest.approx(0.61, abs=1e-7)] * 2 + [0.0], [pytest.approx(0.61, abs=1e-7), 0.0, 0.0]]


def test_position_schedule_defaults_and_refusals_name_what_happened():
    assert PositionGateSchedule().bins == 20  # docs/architecture.md: 20 bins of t/T
    s = PositionGateSchedule(bins=2)
    with pytest.raises(RuntimeError, match=r"^PositionGateSchedule\.gates before freeze\(\)$"):
        s.gates(torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"^PositionGateSchedule\.freeze with no gates collected$"):
        s.freeze()
    s.collect(torch.full((1, 2), 0.5), torch.ones(1, 2, dtype=torch.bool))
    s.freeze()
    with pytest.raises(RuntimeError, match=r"^PositionGateSchedule\.collect after freeze\(\)$"):
        s.collect(torch.full((1, 2), 0.5), torch.ones(1, 2, dtype=torch.bool))


def test_position_schedule_state_round_trips_exactly_in_float64():
    # Sums of gates and token counts are float64 state saved in checkpoints: a reload must give back the
    # same numbers (float32 would turn 0.1 into 0.10000000149 and stop counting at 2**24 tokens a bin).
    state = {"bins": 2, "sum": [0.1, 1e8 + 0.3], "count": [2.0 ** 24, 3.0], "means": [0.1 / 3, 0.7]}
    s = PositionGateSchedule(bins=2)
    s.load_state_dict(state)
    assert s.state_dict() == state
    unfrozen = PositionGateSchedule(bins=2)
    unfrozen.load_state_dict({**state, "means": None})
    unfrozen.collect(torch.tensor([[0.5, 0.25]]), torch.tensor([[True, True]]))  # one more token in each bin
    assert unfrozen.state_dict()["count"] == [2.0 ** 24 + 1, 4.0]


def test_position_schedule_counts_past_2_to_the_24_tokens_a_bin():
    # A real position_steps window sees far more than 2**24 response tokens per bin (20K-token responses x
    # thousands of samples): the fresh schedule must count them exactly.
    n = 2 ** 24 + 1
    s = PositionGateSchedule(bins=1)
    s.collect(torch.full((1, n), 0.5), torch.ones(1, n, dtype=torch.bool))
    assert s.state_dict()["count"] == [float(n)] and s.state_dict()["sum"] == [n * 0.5]


def _position_schedule_over_subgroups(per_rank_kappa):
    """Ranks {0, 1} and {2, 3} each build one schedule over their own DP group."""
    import torch.distributed as dist

    from tests.support.distributed_harness import block_subgroup

    group, _ = block_subgroup(2)
    rank = dist.get_rank()
    s = PositionGateSchedule(bins=2)
    kappa = torch.tensor([per_rank_kappa[rank]])
    s.collect(kappa, torch.ones_like(kappa, dtype=torch.bool), group=group)
    s.freeze()
    return s.state_dict()["means"]


def test_position_schedule_is_built_over_its_data_parallel_group_only():
    from tests.support.threaded_harness import ThreadedPool

    kappa = [[0.1, 0.3], [0.3, 0.5], [0.5, 0.7], [0.9, 0.9]]
    means = ThreadedPool(world_size=4).run(_position_schedule_over_subgroups, kappa)
    assert means[0] == means[1] == pytest.approx([0.2, 0.4]) and means[2] == means[3] == pytest.approx([0.7, 0.8])
