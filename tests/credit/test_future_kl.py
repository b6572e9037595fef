"""future_kl / fipo_weights against loop references from docs/architecture.md's formulas; CP = 2, 4 on gloo."""
import importlib
import math

import pytest
import torch

from megatron_credit.credit.future_kl import fipo_weights, future_kl, masked_summary, multi_dual_clip_keep
from megatron_credit.metrics.tables import FIPO
from tests.references import fipo_weights_reference, future_kl_reference
from tests.support.distributed_harness import block_subgroup, load_balanced_shard
from tests.support.threaded_harness import gloo_and_threads_pool


def make_batch(b, t, seed, *, packed=False, dtype=torch.float64):
    """Rows: prompt (masked), a response of random length (including 0 and 1), padding (masked).

    With ``packed`` rows hold several responses separated by masked (prompt) tokens. Log-ratios are
    spread wide enough that some exceed log(c) and some hit the +-20 clamp.
    """
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    old = logp - torch.randn(b, t, generator=g, dtype=dtype) * 0.8
    old[0, :2] = logp[0, :2] - 25.0  # clamp to +20 (and ratio > c)
    mask = torch.zeros(b, t, dtype=torch.bool)
    lengths = [0, 1] + torch.randint(0, t + 1, (b,), generator=g).tolist()
    for i in range(b):
        if packed:
            pos = 0
            while pos < t:
                pos += int(torch.randint(1, 4, (1,), generator=g))       # prompt / gap
                n = int(torch.randint(0, max(2, t // 3), (1,), generator=g))
                mask[i, pos:pos + n] = True
                pos += n
        else:
            n = min(lengths[i], t)
            start = int(torch.randint(0, t - n + 1, (1,), generator=g))
            mask[i, start:start + n] = True
    # A *valid* token with log-ratio -25: the clamp to -20 changes F there (tokens above log c are
    # excluded by M, so only the lower clamp is observable in F).
    row = next((i for i in range(b) if mask[i].sum() >= 2), None)
    if row is not None:
        p = int(mask[row].nonzero()[0, 0])
        old[row, p] = logp[row, p] + 25.0
    return logp, old, mask


def nan_padded(logp, old, mask, seed=0):
    """The same batch with padding that would poison a multiply-by-mask: logp = old = -inf (their
    difference is NaN), NaN, or +inf at masked positions."""
    g = torch.Generator().manual_seed(seed)
    logp, old = logp.clone(), old.clone()
    kind = torch.randint(0, 3, logp.shape, generator=g)
    pad = ~mask
    for k, (a, b) in enumerate([(-math.inf, -math.inf), (math.nan, math.nan), (math.inf, -math.inf)]):
        sel = pad & (kind == k)
        logp[sel], old[sel] = a, b
    return logp, old


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("t,k,tau", [(1, 128, 32.0), (9, 4, 2.0), (70, 8, 32.0), (300, 128, 8.0)])
def test_future_kl_matches_loop(packed, t, k, tau):
    logp, old, mask = make_batch(5, t, seed=t + int(packed), packed=packed)
    for c in (3.0, 10.0):
        got = future_kl(logp, old, mask, tau=tau, dual_clip_c=c, chunk_size=k, packed=packed)
        ref = future_kl_reference(logp, old, mask, tau=tau, c=c, packed=packed)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_log_ratio_clamp_is_exercised(monkeypatch):
    # make_batch puts a valid token with log-ratio -25; without the clamp F differs there.
    fk = importlib.import_module("megatron_credit.credit.future_kl")  # the package re-exports the function

    logp, old, mask = make_batch(5, 40, seed=3)
    assert ((logp - old)[mask] < -20).any()
    ref = future_kl_reference(logp, old, mask, tau=8.0, c=3.0, packed=False)
    torch.testing.assert_close(future_kl(logp, old, mask, tau=8.0, dual_clip_c=3.0), ref,
                               rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(fk, "LOG_RATIO_CLAMP", 1e6)
    assert not torch.allclose(future_kl(logp, old, mask, tau=8.0, dual_clip_c=3.0), ref)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nan_and_inf_padding_do_not_leak(packed, dtype):
    logp, old, mask = make_batch(6, 70, seed=5, packed=packed, dtype=dtype)
    bad_lp, bad_old = nan_padded(logp, old, mask)
    assert torch.isnan(bad_lp - bad_old).any()
    for k in (8, 128):
        clean = future_kl(logp, old, mask, tau=8.0, dual_clip_c=3.0, chunk_size=k, packed=packed)
        got = future_kl(bad_lp, bad_old, mask, tau=8.0, dual_clip_c=3.0, chunk_size=k, packed=packed)
        assert torch.equal(got, clean)
    adv = torch.randn(6, 70, dtype=dtype)
    bad_adv = adv.masked_fill(~mask, math.nan)
    w_clean, m_clean = fipo_weights(logp, old, adv, mask, tau=8.0, clip=(0.8, 1.2), dual_clip_c=3.0,
                                    packed=packed)
    w, metrics = fipo_weights(bad_lp, bad_old, bad_adv, mask, tau=8.0, clip=(0.8, 1.2), dual_clip_c=3.0,
                              packed=packed)
    assert torch.equal(w, w_clean) and torch.isfinite(w).all()
    for name, value in m_clean.items():
        assert torch.equal(metrics[name], value), name
    keep = multi_dual_clip_keep(bad_lp, bad_old, bad_adv, mask, dual_clip_c=3.0)
    assert torch.equal(keep, multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=3.0))


def test_safety_thresh_is_separate_from_dual_clip_c():
    # ratio e**1.5 = 4.48: above safety_thresh = 4 but below c = 10, so the token is in the future sum
    # (F > 0, f > 1) and, with A < 0, capped at 1 only by the separate safety threshold.
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.5, -1.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w_default, _ = fipo_weights(logp, old, adv, mask, tau=4.0, clip=(1.0, 1.2), dual_clip_c=10.0)
    w, metrics = fipo_weights(logp, old, adv, mask, tau=4.0, clip=(1.0, 1.2), dual_clip_c=10.0,
                              safety_thresh=4.0)
    assert torch.equal(w_default, torch.full((1, 3), 1.2, dtype=torch.float64))
    assert torch.equal(w, torch.tensor([[1.0, 1.2, 1.0]], dtype=torch.float64))
    assert float(metrics["frac_dual_capped"]) == 2 / 3 and float(metrics["frac_dual_masked"]) == 0.0
    ref = fipo_weights_reference(logp, old, adv, mask, tau=4.0, clip=(1.0, 1.2), c=10.0, safety=4.0)
    assert torch.equal(w, ref)
    with pytest.raises(ValueError, match="safety_thresh"):
        fipo_weights(logp, old, adv, mask, safety_thresh=0.0)


def test_future_kl_float32_and_interior_mask_semantics():
    logp, old, mask = make_batch(4, 200, seed=1)
    ref = future_kl_reference(logp, old, mask, tau=32.0, c=10.0, packed=False)
    got = future_kl(logp.float(), old.float(), mask, tau=32.0, dual_clip_c=10.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    # A masked token inside a response (e.g. a tool output) contributes nothing but does not cut the
    # decay when packed=False, and cuts it when packed=True.
    m = torch.ones(1, 6, dtype=torch.bool)
    m[0, 2] = False
    lp, ol = torch.zeros(1, 6, dtype=torch.float64), torch.full((1, 6), -0.1, dtype=torch.float64)
    for packed in (False, True):
        torch.testing.assert_close(future_kl(lp, ol, m, tau=4.0, dual_clip_c=3.0, packed=packed),
                                   future_kl_reference(lp, ol, m, tau=4.0, c=3.0, packed=packed))
    assert future_kl(lp, ol, m, tau=4.0, dual_clip_c=3.0)[0, 0] > future_kl(
        lp, ol, m, tau=4.0, dual_clip_c=3.0, packed=True)[0, 0]


def test_zero_length_batch_and_bad_args():
    z = torch.zeros(2, 0, dtype=torch.float64)
    assert future_kl(z, z, z.bool(), tau=32.0, dual_clip_c=10.0).shape == (2, 0)
    w, metrics = fipo_weights(z, z, z, z.bool())
    assert w.shape == (2, 0) and torch.isnan(metrics["mean"])
    with pytest.raises(ValueError, match="dual_clip_c"):
        future_kl(z, z, z.bool(), tau=32.0, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="clip"):
        fipo_weights(z, z, z, z.bool(), clip=(1.2, 1.0))


@pytest.mark.parametrize("clip,c", [((1.0, 1.2), 10.0), ((0.8, 1.2), 3.0)])
def test_fipo_weights_match_loop_and_metrics(clip, c):
    logp, old, mask = make_batch(6, 90, seed=7)
    logp = logp.clone().requires_grad_(True)
    adv = torch.randn(6, 90, dtype=torch.float64)
    w, metrics = fipo_weights(logp, old, adv, mask, tau=8.0, clip=clip, dual_clip_c=c, chunk_size=16)
    assert not w.requires_grad
    ref = fipo_weights_reference(logp.detach(), old, adv, mask, tau=8.0, clip=clip, c=c)
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-12)
    vals = ref[mask]
    d = (logp.detach() - old).clamp(-20, 20)
    over = (d > math.log(c)) & mask
    expect = {
        "mean": vals.mean(), "min": vals.min(), "max": vals.max(), "dev_sq": ((vals - 1) ** 2).mean(),
        "frac_at_low": (vals <= clip[0]).double().mean(), "frac_at_high": (vals >= clip[1]).double().mean(),
        "frac_dual_masked": over.sum().double() / mask.sum(),
        "frac_dual_capped": (over & (adv < 0)).sum().double() / mask.sum(),
    }
    assert set(metrics) == set(expect)
    for name, value in expect.items():
        torch.testing.assert_close(metrics[name], value.to(torch.float64), rtol=1e-12, atol=1e-12,
                                   msg=name)
    assert expect["frac_dual_masked"] > 0 and expect["frac_at_high"] > 0  # the cases were exercised
    # the quantiles are masked_summary's, asked for where they are read (fipo_weights computes none)
    q = masked_summary(ref, mask, quantiles=(0.1, 0.5, 0.9))
    for name, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
        torch.testing.assert_close(q[name], torch.quantile(vals, p), rtol=1e-12, atol=1e-12, msg=name)


def test_fipo_weights_are_one_on_policy():
    # First mini-batch of an iteration: logp == old_logp, F = 0, so f = clamp(1, lo, hi) = 1 for lo <= 1.
    logp, _, mask = make_batch(3, 50, seed=2)
    w, _ = fipo_weights(logp, logp, torch.randn(3, 50, dtype=torch.float64), mask)
    torch.testing.assert_close(w, torch.ones_like(w))


def test_masked_summary_empty_and_single():
    v = torch.tensor([[3.0, 7.0]])
    out = masked_summary(v, torch.tensor([[False, True]]))
    assert all(float(x) == 7.0 for x in out.values())
    out = masked_summary(v, torch.zeros(1, 2, dtype=torch.bool))
    assert all(torch.isnan(x) for x in out.values())


def test_multi_dual_clip_keep():
    logp = torch.zeros(5, 4, dtype=torch.float64)
    old = torch.tensor([[0.0, 0, 0, 0], [-3, 0, 0, 0], [-3, -3, 0, 0], [-3, -3, -3, 0], [-3, 0, 0, -3]],
                       dtype=torch.float64)                                   # exp(3) = 20 > c = 10
    adv = -torch.ones(5, 4, dtype=torch.float64)
    adv[3, :2] = 1.0     # ratio > c but A > 0: the dual clip is not active, not counted
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[4, 3] = False   # a masked clipped token is not counted
    keep = multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=10.0)
    assert keep.tolist() == [True, True, False, True, True]
    keep = multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=10.0, max_dual_clipped=0)
    assert keep.tolist() == [True, False, False, False, False]


# ---------------------------------------------------------------------------- context parallel (gloo)

cp_shard = load_balanced_shard


def _cp_future_kl_worker(cases):
    import torch.distributed as dist

    groups = {cp: block_subgroup(cp)[0] for cp in (2, 4)}
    out = []
    for logp, old, mask, adv, packed, k in cases:
        for cp in (2, 4):
            r = dist.get_rank(groups[cp])
            lp, ol, m, a = (cp_shard(v, cp, r) for v in (logp, old, mask, adv))
            f = future_kl(lp, ol, m, tau=8.0, dual_clip_c=3.0, chunk_size=k, cp_group=groups[cp],
                          packed=packed)
            w, _ = fipo_weights(lp, ol, a, m, tau=8.0, clip=(0.8, 1.2), dual_clip_c=3.0, chunk_size=k,
                                cp_group=groups[cp], packed=packed)
            out.append((cp, r, f, w))
    return out


def _cp_multi_dual_clip_worker(logp, old, adv, mask):
    import torch.distributed as dist

    rank = dist.get_rank()
    g = dist.new_group([0, 1])
    dist.new_group([2, 3])  # every rank must call new_group for every group
    if rank > 1:
        return None
    args = [cp_shard(v, 2, rank) for v in (logp, old, adv, mask)]
    return (multi_dual_clip_keep(*args, dual_clip_c=10.0, cp_group=g),
            multi_dual_clip_keep(*args, dual_clip_c=10.0))


def test_multi_dual_clip_keep_counts_whole_response_under_cp(pool):
    # T = 8 at CP = 2: rank 0 holds positions 0-1 and 6-7, rank 1 holds 2-5. Row 0 has one clipped token
    # on each rank (2 in all: dropped, though each rank alone sees 1); row 1 has one in all (kept).
    logp = torch.zeros(2, 8, dtype=torch.float64)
    old = torch.zeros(2, 8, dtype=torch.float64)
    old[0, 0] = old[0, 3] = old[1, 7] = -3.0
    adv = -torch.ones(2, 8, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    assert multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=10.0).tolist() == [False, True]
    results = pool.run(_cp_multi_dual_clip_worker, logp, old, adv, mask)
    for rank in (0, 1):
        with_cp, local = results[rank]
        assert with_cp.tolist() == [False, True]
        assert local.tolist() == [True, True]  # what a rank would wrongly decide from its share alone


pool = gloo_and_threads_pool(4)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


def test_cp_2_and_4_equal_unsharded(pool):
    cases = []
    for seed, (t, k, packed) in enumerate([(16, 4, False), (16, 4, True), (240, 16, False),
                                           (240, 8, True), (1024, 128, False)]):
        logp, old, mask = make_batch(3, t, seed=seed, packed=packed)
        cases.append((logp, old, mask, torch.randn(3, t, dtype=torch.float64), packed, k))
    results = pool.run(_cp_future_kl_worker, cases)
    for rank_results in results:
        it = iter(rank_results)
        for logp, old, mask, adv, packed, k in cases:
            full_f = future_kl(logp, old, mask, tau=8.0, dual_clip_c=3.0, chunk_size=k, packed=packed)
            full_w, _ = fipo_weights(logp, old, adv, mask, tau=8.0, clip=(0.8, 1.2), dual_clip_c=3.0,
                                     chunk_size=k, packed=packed)
            for cp in (2, 4):
                got_cp, r, f, w = next(it)
                assert got_cp == cp
                torch.testing.assert_close(f, cp_shard(full_f, cp, r), rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(w, cp_shard(full_w, cp, r), rtol=1e-12, atol=1e-12)


def test_fipo_weight_std_from_micro_batch_sums_is_the_std_over_every_token():
    # The trainer turns each micro-batch's means into token-weighted sums and finalize() derives
    # fipo/weight_std from the first two moments: it must be the (population) std over all valid tokens
    # of the iteration, whatever the split into micro-batches.
    from megatron_credit.metrics.sums import StatSums, finalize

    stats, every = StatSums(), []
    for seed, (b, t) in enumerate([(3, 40), (5, 17)]):
        logp, old, mask = make_batch(b, t, seed=seed + 11)
        logp = old + 0.4 * (logp - old)  # moderate ratios: weights spread inside (1, 1.2), some at the clip
        w, m = fipo_weights(logp, old, torch.randn(b, t, dtype=torch.float64), mask, tau=8.0, chunk_size=16)
        n = mask.sum().double()
        stats.add({"sum:tokens": n, "sum:fipo_weight/mean": m["mean"] * n, "sum:fipo_weight/dev_sq": m["dev_sq"] * n})
        every.append(w[mask])
    allw = torch.cat(every)
    out = finalize(stats)
    assert 0 < float(allw.std(unbiased=False)) and allw.max() > allw.min()
    assert out["fipo/weight_std"] == pytest.approx(float(allw.std(unbiased=False)), rel=1e-9, abs=1e-12)
    assert out["fipo/weight_mean"] == pytest.approx(float(allw.mean()), rel=1e-12)


# ------------------------------------------------------------------- mutation killers
def test_fipo_weights_defaults_are_the_papers():
    # docs/architecture.md: tau 32, dual-clip constant 10, rows of one response each (packed False), clip [1, 1.2].
    logp, old, mask = make_batch(6, 40, seed=21, packed=True)
    old[:, 5] = logp[:, 5] - math.log(10.5)  # ratio 10.5: inside M at c = 11, outside at c = 10
    adv = -torch.ones_like(logp)
    w, m = fipo_weights(logp, old, adv, mask)
    explicit, _ = fipo_weights(logp, old, adv, mask, tau=32.0, dual_clip_c=10.0, packed=False, clip=(1.0, 1.2))
    assert torch.equal(w, explicit)
    for other in ({"tau": 33.0}, {"dual_clip_c": 11.0}, {"packed": True}):
        assert not torch.equal(w, fipo_weights(logp, old, adv, mask, **other)[0]), other
    # every statistic is one the trainer reduces (metrics/tables.FIPO), none computed to be dropped
    assert set(m) == {"mean", "min", "max", "dev_sq", "frac_at_low", "frac_at_high", "frac_dual_masked",
                      "frac_dual_capped"}
    assert {f"fipo_weight/{k}" for k in m} <= set(FIPO.reduce)


def test_fipo_weights_settings_are_checked_at_their_bounds():
    logp, old, mask = make_batch(3, 12, seed=22)
    adv = torch.ones_like(logp)
    fipo_weights(logp, old, adv, mask, dual_clip_c=1.5)  # any c > 1 is a dual-clip constant
    fipo_weights(logp, old, adv, mask, safety_thresh=0.5)  # any threshold > 0
    future_kl(logp, old, mask, tau=0.5, dual_clip_c=10.0)  # any tau > 0
    for kwargs, message in (({"dual_clip_c": 1.0}, "dual_clip_c must be > 1, got 1.0"),
                            ({"clip": (0.0, 1.2)}, "clip must satisfy 0 < clip[0] <= clip[1], got (0.0, 1.2)")):
        with pytest.raises(ValueError, match=f"^{re_escape(message)}$"):
            fipo_weights(logp, old, adv, mask, **kwargs)
    with pytest.raises(ValueError, match=r"^tau must be > 0, got 0$"):
        future_kl(logp, old, mask, tau=0, dual_clip_c=10.0)


def re_escape(s):
    import re

    return re.escape(s)


def test_a_zero_advantage_token_is_not_capped():
    # The safety cap min(f, 1) applies where A < 0 and the ratio exceeds the threshold; A = 0 is not < 0.
    logp = torch.zeros(1, 4, dtype=torch.float64)
    old = logp - torch.tensor([[0.0, 3.0, 0.5, 0.5]], dtype=torch.float64)  # token 1: ratio e^3 > 10
    mask = torch.ones(1, 4, dtype=torch.bool)
    w, m = fipo_weights(logp, old, torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64), mask,
                        clip=(0.5, 2.0), tau=1.0)
    capped, _ = fipo_weights(logp, old, torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64), mask,
                             clip=(0.5, 2.0), tau=1.0)
    assert float(w[0, 1]) > 1.0 and float(capped[0, 1]) == 1.0 and float(m["frac_dual_capped"]) == 0.0


def test_weight_statistics_of_a_single_valid_token():
    logp = torch.zeros(1, 3, dtype=torch.float64)
    old = logp - torch.tensor([[0.0, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False]])
    w, m = fipo_weights(logp, old, torch.ones_like(logp), mask, tau=1.0)
    f = float(w[0, 1])
    assert f > 1.0
    assert float(m["mean"]) == f and float(m["dev_sq"]) == pytest.approx((f - 1) ** 2, rel=1e-12)
    assert float(m["frac_at_low"]) == 0.0 and float(m["frac_at_high"]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8])
def test_future_kl_reads_any_0_1_mask_like_a_bool_mask(dtype):
    logp, old, mask = make_batch(5, 24, seed=23, packed=True)
    want = future_kl(logp, old, mask, tau=4.0, dual_clip_c=10.0, packed=True)
    got = future_kl(logp, old, mask.to(dtype), tau=4.0, dual_clip_c=10.0, packed=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_summary_of_an_empty_tensor_has_every_key():
    out = masked_summary(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool))
    assert list(out) == ["mean", "min", "max", "p10", "p50", "p90"] and all(math.isnan(float(v)) for v in out.values())


@pytest.mark.parametrize("packed", [False, True])
def test_empty_row_slots_pass_the_transport_on_unchanged(packed):
    # A packed micro-batch's row view under CP (batch/packing.py): each half of a row ends with empty slots.
    # With them marked, the Future-KL of the tokens equals the loop reference on the row without them.
    logp, old, mask = make_batch(4, 24, seed=5, packed=packed)
    g = torch.Generator().manual_seed(9)
    slots = torch.ones(4, 40, dtype=torch.bool)
    spread = []
    for i in range(4):  # 16 empty slots at random places of each row; the tokens keep their order
        empty = torch.randperm(40, generator=g)[:16]
        slots[i, empty] = False
        spread.append(slots[i].nonzero().flatten())
    wide = lambda x, fill: torch.stack([torch.full((40,), fill, dtype=x.dtype).index_put((spread[i],), x[i])  # noqa: E731
                                        for i in range(4)])
    got = future_kl(wide(logp, 0.0), wide(old, 0.0), wide(mask, False), tau=8.0, dual_clip_c=3.0, chunk_size=4,
                    packed=packed, row_slots=slots)
    ref = future_kl_reference(logp, old, mask, tau=8.0, c=3.0, packed=packed)
    torch.testing.assert_close(torch.stack([got[i, spread[i]] for i in range(4)]), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[~slots], torch.zeros(int((~slots).sum()), dtype=got.dtype))
