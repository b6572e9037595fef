"""GAE / Comp-GAE and the CompPO gate against loop references from docs/architecture.md's formulas."""
import math

import pytest
import torch

from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.gates import comppo_gate, concentration_from_lse, normalized_concentration
from tests.references import comp_gae_reference, comppo_gate_reference, gae_reference
from tests.support.distributed_harness import block_subgroup, load_balanced_shard
from tests.support.threaded_harness import gloo_and_threads_pool


def make_batch(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    gates = torch.rand(b, t, generator=g, dtype=torch.float64)
    gates[torch.rand(b, t, generator=g) < 0.1] = 0.0  # zero gates cut the transport
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = [0, 1][i] if i < 2 else int(torch.randint(0, t + 1, (1,), generator=g))
        start = int(torch.randint(0, t - n + 1, (1,), generator=g))
        mask[i, start:start + n] = True
    rewards = rewards * mask  # rewards live on response tokens
    return rewards, values, gates, mask


@pytest.mark.parametrize("t,k", [(1, 128), (2, 2), (37, 4), (300, 128), (1000, 16)])
def test_comp_gae_matches_loop(t, k):
    r, v, kappa, mask = make_batch(5, t, seed=t)
    adv, ret = comp_gae(r, v, kappa, mask, lam=0.95, chunk_size=k)
    ref_adv, ref_ret = comp_gae_reference(r, v, kappa, mask, 0.95)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_loop_and_is_comp_gae_with_constant_gate(gamma, lam):
    r, v, _, mask = make_batch(6, 120, seed=3)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    # gae is implemented through comp_gae, so it is checked against the independent textbook loop.
    ref_adv, ref_ret = gae_reference(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    # ... and the Comp-GAE loop reference with a constant gate agrees with it.
    cg_adv, cg_ret = comp_gae_reference(r, v, torch.full_like(v, gamma), mask, lam)
    torch.testing.assert_close(cg_adv, ref_adv, rtol=1e-12, atol=1e-12)
    # The reduction from the CompPO paper: a constant gate gamma is GAE, bit for bit.
    c_adv, c_ret = comp_gae(r, v, torch.full_like(v, gamma), mask, lam=lam)
    assert torch.equal(c_adv, adv) and torch.equal(c_ret, ret)


@pytest.mark.parametrize("k", [4, 128])
def test_nan_and_inf_padding_do_not_leak(k):
    r, v, kappa, mask = make_batch(6, 90, seed=17)
    mask[5, 40:50] = False  # a masked gap inside a row: two responses
    g = torch.Generator().manual_seed(1)
    kind = torch.randint(0, 3, mask.shape, generator=g)
    pads = [math.nan, math.inf, -math.inf]
    bad = [x.clone() for x in (r, v, kappa)]
    for x in bad:
        for j, val in enumerate(pads):
            x[~mask & (kind == j)] = val
    clean_adv, clean_ret = comp_gae(r * mask, v, kappa, mask, lam=0.9, chunk_size=k)
    adv, ret = comp_gae(*bad, mask, lam=0.9, chunk_size=k)
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)
    ref_adv, ref_ret = comp_gae_reference(r * mask, v, kappa, mask, 0.9)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    g_adv, g_ret = gae(bad[0], bad[1], mask, gamma=0.99, lam=0.9, chunk_size=k)
    ref_adv, ref_ret = gae_reference(r * mask, v, mask, 0.99, 0.9)
    torch.testing.assert_close(g_adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_gae_textbook_case():
    # One response filling the row, terminal reward: with gamma = lam = 1, A_t = R - V_t.
    v = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = gae(r, v, torch.ones(1, 4), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, 1.0 - v)
    torch.testing.assert_close(ret, torch.ones(1, 4, dtype=torch.float64))


def test_gae_float32_and_detached():
    r, v, kappa, mask = make_batch(3, 500, seed=9)
    v32 = v.float().requires_grad_(True)
    adv, ret = comp_gae(r.float(), v32, kappa.float(), mask, lam=0.95)
    assert adv.dtype == torch.float32 and not adv.requires_grad and not ret.requires_grad
    ref_adv, _ = comp_gae_reference(r, v, kappa, mask, 0.95)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="same"):
        comp_gae(r, v, kappa[:, :-1], mask, lam=0.95)


def test_comppo_gate_matches_formula():
    g = torch.Generator().manual_seed(0)
    n = torch.randint(1, 50, (200,), generator=g)
    # A valid concentration lies in [1/n, 1].
    h = 1.0 / n + torch.rand(200, generator=g, dtype=torch.float64) * (1.0 - 1.0 / n)
    kappa = comppo_gate(h, n, k_lo=0.1, k_hi=0.9, tau=4.0)
    ref = comppo_gate_reference(h, n, k_lo=0.1, k_hi=0.9, tau=4.0)
    for i in range(200):
        assert abs(float(kappa[i]) - float(ref[i])) < 1e-12
    assert torch.all(kappa >= 0.1) and torch.all(kappa <= 0.9)
    # Uniform attention -> c = 0, a single visible key or one-hot attention -> c = 1.
    torch.testing.assert_close(normalized_concentration(torch.tensor([0.25, 1.0, 1.0]), torch.tensor([4, 4, 1])),
                               torch.tensor([0.0, 1.0, 1.0]))
    with pytest.raises(ValueError):
        comppo_gate(h, n, k_lo=0.9, k_hi=0.1)


def test_concentration_from_lse():
    s = torch.randn(3, 17, dtype=torch.float64)
    h = concentration_from_lse(torch.logsumexp(2 * s, -1), torch.logsumexp(s, -1))
    torch.testing.assert_close(h, (torch.softmax(s, -1) ** 2).sum(-1))


# ---------------------------------------------------------------------------- context parallel (gloo)

cp_shard = load_balanced_shard


def _cp_gae_worker(cases):
    groups = {cp: block_subgroup(cp) for cp in (2, 4)}
    out = []
    for r_, v, kappa, mask, k in cases:
        for cp, (g, r) in groups.items():
            shards = (cp_shard(x, cp, r) for x in (r_, v, kappa, mask))
            adv, ret = comp_gae(*shards, lam=0.95, chunk_size=k, cp_group=g)
            out.append((cp, r, adv, ret))
    return out


pool = gloo_and_threads_pool(4)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


def test_comp_gae_cp_2_and_4_equal_unsharded(pool):
    cases = []
    for seed, (t, k) in enumerate([(8, 2), (16, 4), (240, 8), (1024, 128)]):
        r, v, kappa, mask = make_batch(4, t, seed=100 + seed)
        mask[3] = True  # one response spanning every chunk boundary
        cases.append((r * mask, v, kappa, mask, k))
    for rank_results in pool.run(_cp_gae_worker, cases):
        it = iter(rank_results)
        for r, v, kappa, mask, k in cases:
            ref_adv, ref_ret = comp_gae_reference(r, v, kappa, mask, 0.95)
            for _ in (2, 4):
                cp, rank, adv, ret = next(it)
                torch.testing.assert_close(adv, cp_shard(ref_adv, cp, rank), rtol=1e-11, atol=1e-11)
                torch.testing.assert_close(ret, cp_shard(ref_ret, cp, rank), rtol=1e-11, atol=1e-11)


def _cp_gae_edges_worker(r_, v, mask):
    group, rank = block_subgroup(2)
    adv, ret = gae(*(cp_shard(x, 2, rank) for x in (r_, v, mask)), gamma=0.9, lam=0.95, chunk_size=4,
                   cp_group=group)
    try:  # 2 rows, odd local length 3
        comp_gae(*(torch.zeros(2, 3) for _ in range(3)), torch.ones(2, 3, dtype=torch.bool), lam=0.9,
                 cp_group=group)
        message = None
    except ValueError as e:
        message = str(e)
    return rank, adv, ret, message


def test_gae_under_cp_and_odd_shards(pool):
    # PPO's GAE under CP passes its group on to Comp-GAE (the carries and the next-token halo cross ranks);
    # an odd local length is refused with the length named.
    r, v, _, mask = make_batch(4, 16, seed=7)
    mask[3] = True
    ref_adv, ref_ret = gae_reference(r * mask, v, mask, 0.9, 0.95)
    for rank, adv, ret, message in pool.run(_cp_gae_edges_worker, r * mask, v, mask):
        torch.testing.assert_close(adv, cp_shard(ref_adv, 2, rank), rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(ret, cp_shard(ref_ret, 2, rank), rtol=1e-11, atol=1e-11)
        assert message == "with cp_group the local length must hold two equal chunks, got 3"


def test_comp_gae_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"^rewards, values, gates and response_mask must have the same \[B, T\] shape"):
        comp_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), lam=0.9)
