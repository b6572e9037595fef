"""Policy losses and aggregation against loop references; micro-batch and DP (gloo) invariance."""
import math

import pytest
import torch

from megatron_credit.credit.future_kl import fipo_weights
from megatron_credit.losses.policy import AGG_MODES, aggregate_loss
from tests.support.loss_settings import fipo_policy_loss, gspo_loss, ppo_clip_loss
from megatron_credit.losses.importance import truncated_is_weights
from tests.references import aggregate_reference, ppo_reference
from tests.support.distributed_harness import block_subgroup, load_balanced_shard
from tests.support.threaded_harness import gloo_and_threads_pool


def make_batch(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.6  # ratios on both sides of clip
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        n = [0, 1][i] if i < 2 else int(torch.randint(1, t + 1, (1,), generator=g))
        start = int(torch.randint(0, t - n + 1, (1,), generator=g))
        mask[i, start:start + n] = True
    return logp, old, adv, mask


@pytest.mark.parametrize("el,eh,c", [(0.2, 0.28, 3.0), (0.2, 0.2, None), (0.1, 0.5, 1.5)])
def test_ppo_clip_loss_matches_loop(el, eh, c):
    logp, old, adv, mask = make_batch(6, 40, seed=int(eh * 100))
    isw, _ = truncated_is_weights(old, old + 0.3 * torch.randn_like(old), mask, cap=1.2)
    for weights in (None, isw):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = ppo_clip_loss(lp, old, adv, mask, clip_low=el, clip_high=eh, dual_clip_c=c,
                                      is_weights=weights)
        loss.sum().backward()
        ref_loss, ref_grad = ppo_reference(logp, old, adv, mask, el=el, eh=eh, c=c, isw=weights)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-12)
    r = torch.exp(logp - old)[mask]
    a = adv[mask]
    expect = {
        "clipfrac_low": ((a < 0) & (r < 1 - el)).double().mean(),
        "clipfrac_high": ((a > 0) & (r > 1 + eh)).double().mean(),
        "clipfrac_dual": ((a < 0) & (r > c)).double().mean() if c else torch.tensor(0.0, dtype=torch.float64),
        "approx_kl": (r - 1 - torch.log(r)).mean(),
    }
    for k, v in expect.items():
        if k == "approx_kl":  # expm1(lr) - lr vs r - 1 - log r: equal up to float64 rounding
            torch.testing.assert_close(metrics[k], v, rtol=1e-12, atol=1e-15, msg=k)
        else:  # fractions: the same count over the same denominator, exactly
            assert torch.equal(metrics[k], v), k
        assert not metrics[k].requires_grad
    assert expect["clipfrac_low"] > 0 and expect["clipfrac_high"] > 0
    if c:
        assert expect["clipfrac_dual"] > 0


def _pad_with_nan(logp, old, adv, mask):
    """Padding that poisons multiply-by-mask: logp = old = -inf (log-ratio NaN), NaN advantages."""
    bad = [x.clone() for x in (logp, old, adv)]
    bad[0][~mask] = -math.inf
    bad[1][~mask] = -math.inf
    bad[2][~mask] = math.nan
    return bad


@pytest.mark.parametrize("name", ["ppo", "gspo", "fipo"])
def test_nan_padding_does_not_leak_into_loss_grad_or_metrics(name):
    logp, old, adv, mask = make_batch(6, 40, seed=31)
    if name == "gspo":
        old = logp + 0.02 * torch.randn_like(logp)
    bad_lp, bad_old, bad_adv = _pad_with_nan(logp, old, adv, mask)
    isw, _ = truncated_is_weights(old, old + 0.3 * torch.randn_like(old), mask, cap=1.2)
    bad_isw = isw.masked_fill(~mask, math.nan)
    fn = {"ppo": ppo_clip_loss, "gspo": gspo_loss, "fipo": fipo_policy_loss}[name]
    outs = []
    for lp0, ol, a, w in ((logp, old, adv, isw), (bad_lp, bad_old, bad_adv, bad_isw)):
        lp = lp0.clone().requires_grad_(True)
        loss, metrics = fn(lp, ol, a, mask, is_weights=w)
        agg = aggregate_loss(loss, mask, mode="token-mean")
        agg.backward()
        outs.append((loss.detach(), agg.detach(), lp.grad, metrics))
    (loss, agg, grad, metrics), (bloss, bagg, bgrad, bmetrics) = outs
    assert torch.isfinite(bloss).all() and torch.isfinite(bgrad).all()
    assert torch.equal(bloss, loss) and torch.equal(bagg, agg) and torch.equal(bgrad, grad)
    for k, v in metrics.items():
        assert torch.equal(bmetrics[k], v), k


def test_dual_clip_requires_c_above_one():
    logp, old, adv, mask = make_batch(2, 4, seed=0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip_c=1.0)


def test_grpo_is_fipo_with_unit_weights():
    logp, old, adv, mask = make_batch(5, 60, seed=4)
    for lp_val, clip in ((logp, (1.0, 1.0)), (old, (1.0, 1.2))):  # unit clip, or on-policy (F = 0)
        lp1, lp2 = lp_val.clone().requires_grad_(True), lp_val.clone().requires_grad_(True)
        l_fipo, _ = fipo_policy_loss(lp1, old, adv, mask, weight_clip=clip, dual_clip_c=3.0)
        l_dapo, _ = ppo_clip_loss(lp2, old, adv, mask, dual_clip_c=3.0)
        assert torch.equal(l_fipo, l_dapo)
        aggregate_loss(l_fipo, mask, mode="token-mean").backward()
        aggregate_loss(l_dapo, mask, mode="token-mean").backward()
        assert torch.equal(lp1.grad, lp2.grad)
    # In general FIPO is DAPO on the weighted advantages f * A.
    w, _ = fipo_weights(logp, old, adv, mask, tau=8.0, clip=(0.8, 1.2), dual_clip_c=3.0)
    l_fipo, m = fipo_policy_loss(logp, old, adv, mask, tau=8.0, weight_clip=(0.8, 1.2), dual_clip_c=3.0)
    torch.testing.assert_close(l_fipo, ppo_clip_loss(logp, old, adv * w, mask, dual_clip_c=3.0)[0])
    assert "fipo_weight/mean" in m and not torch.equal(w[mask], torch.ones_like(w[mask]))


def test_gspo_matches_sequence_level_gspo():
    logp, old, _, mask = make_batch(6, 30, seed=8)
    old = logp + 0.02 * torch.randn_like(logp)  # sequence ratios near 1 so both clip sides occur
    seq_adv = torch.randn(6, dtype=torch.float64)
    adv = seq_adv[:, None] * mask
    el, eh = 3e-3, 4e-3
    lp = logp.clone().requires_grad_(True)
    per_token, _ = gspo_loss(lp, old, adv, mask, clip_low=el, clip_high=eh)
    aggregate_loss(per_token, mask, mode="seq-mean-token-mean").backward()
    # Sequence-level GSPO: s_i = exp(mean_t (logp - old)), J = mean_i max(-A s_i, -A clip(s_i)).
    lp_ref = logp.clone().requires_grad_(True)
    total = 0.0
    for i in range(6):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = torch.exp(((lp_ref[i] - old[i]) * mask[i]).sum() / n)
        total = total + torch.maximum(-seq_adv[i] * s, -seq_adv[i] * s.clamp(1 - el, 1 + eh))
        # Token values equal the sequence value.
        seq_loss = torch.maximum(-seq_adv[i] * s, -seq_adv[i] * s.clamp(1 - el, 1 + eh)).detach()
        torch.testing.assert_close(per_token[i][mask[i]].detach(), seq_loss.expand(n))
    (total / 6).backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- aggregation

@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_loop(mode):
    _, _, l, mask = make_batch(7, 25, seed=1)
    got = aggregate_loss(l, mask, mode=mode, norm_length=25)
    ref = aggregate_reference(l, mask, mode, int(mask.sum()), 7, 25)
    assert abs(float(got) - ref) < 1e-12
    got = aggregate_loss(l, mask, mode=mode, global_num_tokens=1000, global_num_seqs=40, norm_length=64,
                         seq_num_tokens=mask.sum(-1))
    assert abs(float(got) - aggregate_reference(l, mask, mode, 1000, 40, 64)) < 1e-12
    with pytest.raises(ValueError, match="valid modes"):
        aggregate_loss(l, mask, mode="sum")
    # Padding that would poison a multiply-by-mask does not reach the reduction.
    bad = l.masked_fill(~mask, math.nan)
    assert torch.equal(aggregate_loss(bad, mask, mode=mode, norm_length=25), aggregate_loss(
        l, mask, mode=mode, norm_length=25))


def test_aggregate_refuses_defaults_that_scale_with_cp():
    # Under CP a rank's T is T_global / cp and its mask.sum(-1) is part of each row: defaults built on
    # them would scale the loss by cp. They are refused instead of guessed.
    _, _, l, mask = make_batch(4, 12, seed=2)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(l, mask, mode="seq-mean-token-sum-norm", global_num_seqs=4)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(l, mask, mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq_num_tokens"):
        aggregate_loss(l, mask, mode="seq-mean-token-mean", global_num_seqs=4)
    # Single process, no global counts: local counts are the whole responses' counts.
    torch.testing.assert_close(aggregate_loss(l, mask, mode="seq-mean-token-mean"),
                               aggregate_loss(l, mask, mode="seq-mean-token-mean", global_num_seqs=4,
                                              seq_num_tokens=mask.sum(-1)), rtol=0, atol=0)


def _loss_and_grad(theta, logp0, old, adv, mask, mode, n_tok, n_seq, pieces):
    """Gradient of the summed loss of ``pieces`` micro-batches (rows split, columns trimmed per piece)."""
    theta = theta.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.tensor_split(torch.arange(logp0.shape[0]), pieces):
        # A micro-batch is padded only to its own longest response: trim trailing all-masked columns.
        t_mb = int(mask[rows].nonzero()[:, 1].max()) + 1 if mask[rows].any() else 1
        lp = (logp0[rows] + theta)[:, :t_mb]
        per_token, _ = ppo_clip_loss(lp, old[rows, :t_mb], adv[rows, :t_mb], mask[rows, :t_mb])
        loss = aggregate_loss(per_token, mask[rows, :t_mb], mode=mode, global_num_tokens=n_tok,
                              global_num_seqs=n_seq, norm_length=logp0.shape[1],
                              seq_num_tokens=mask[rows, :t_mb].sum(-1))
        loss.backward()
        total += float(loss.detach())
    return total, theta.grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_invariance(mode):
    logp, old, adv, mask = make_batch(8, 30, seed=11)
    theta = 0.1 * torch.randn(30, dtype=torch.float64)  # a shared "parameter" all rows depend on
    n_tok, n_seq = mask.sum(), 8
    base_loss, base_grad = _loss_and_grad(theta, logp, old, adv, mask, mode, n_tok, n_seq, 1)
    assert base_grad.abs().sum() > 0
    for pieces in (2, 4):
        loss, grad = _loss_and_grad(theta, logp, old, adv, mask, mode, n_tok, n_seq, pieces)
        assert abs(loss - base_loss) < 1e-12
        torch.testing.assert_close(grad, base_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sequence_split_invariance(mode):
    # Context parallelism splits each row along T: with the whole responses' counts passed in, the sum
    # of the shards' losses is the loss of the whole batch.
    _, _, l, mask = make_batch(6, 24, seed=21)
    full = aggregate_loss(l, mask, mode=mode, global_num_tokens=mask.sum(), global_num_seqs=6,
                          norm_length=24, seq_num_tokens=mask.sum(-1))
    parts = [aggregate_loss(l[:, sl], mask[:, sl], mode=mode, global_num_tokens=mask.sum(),
                            global_num_seqs=6, norm_length=24, seq_num_tokens=mask.sum(-1))
             for sl in (slice(0, 5), slice(5, 16), slice(16, 24))]
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-14)


def _dp_worker(batch, theta, mode):
    """Each rank of a DP group takes its rows, computes the global denominators by all-reduce, and
    all-reduces its gradient; the result must equal the single-rank gradient of the whole batch."""
    import torch.distributed as dist

    logp, old, adv, mask = batch
    groups = {dp: block_subgroup(dp) for dp in (1, 2, 4)}
    out = {}
    for dp, (g, r) in groups.items():
        rows = torch.tensor_split(torch.arange(logp.shape[0]), dp)[r]
        counts = torch.stack([mask[rows].sum().double(), torch.tensor(float(len(rows)), dtype=torch.float64)])
        dist.all_reduce(counts, group=g)  # once per step, over DP (x CP)
        th = theta.clone().requires_grad_(True)
        per_token, _ = ppo_clip_loss(logp[rows] + th, old[rows], adv[rows], mask[rows])
        aggregate_loss(per_token, mask[rows], mode=mode, global_num_tokens=counts[0],
                       global_num_seqs=counts[1], norm_length=logp.shape[1],
                       seq_num_tokens=mask[rows].sum(-1)).backward()
        grad = th.grad.clone()
        dist.all_reduce(grad, group=g)
        out[dp] = grad
    return out


pool = gloo_and_threads_pool(4)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


def test_dp_invariance_on_gloo(pool):
    batch = make_batch(8, 20, seed=12)
    theta = 0.1 * torch.randn(20, dtype=torch.float64)
    for mode in AGG_MODES:
        results = pool.run(_dp_worker, batch, theta, mode)
        base = results[0][1]
        assert base.abs().sum() > 0
        for per_rank in results:
            for dp in (1, 2, 4):
                torch.testing.assert_close(per_rank[dp], base, rtol=1e-12, atol=1e-14)


_cp_shard = load_balanced_shard


def _cp_loss_worker(loss_fn, kwargs, logp, old, adv, mask):
    """This rank's shard of ``loss_fn`` and its gradient at CP = 2 and 4 (blocks of ranks); at CP = 2 the
    second pair holds the batch's rows reversed: other responses, as in a DP x CP layout."""
    import torch.distributed as dist

    out = {}
    for cp in (2, 4):
        group, r = block_subgroup(cp)
        batch = (logp, old, adv, mask)
        if cp == 2 and dist.get_rank() >= 2:
            batch = tuple(x.flip(0) for x in batch)
        lp = _cp_shard(batch[0], cp, r).clone().requires_grad_(True)
        loss, _ = loss_fn(lp, *(_cp_shard(x, cp, r) for x in batch[1:]), cp_group=group, **kwargs)
        loss.sum().backward()
        out[cp] = (r, loss.detach(), lp.grad)
    return out


def _check_cp_loss(pool, loss_fn, kwargs, *, seed, noise):
    """``loss_fn`` on CP shards equals the unsharded loss's shard, with its gradient (returns the batch)."""
    logp, _, _, mask = make_batch(4, 32, seed=seed)
    old = logp + noise * torch.randn_like(logp)
    adv = torch.randn(4, 1, dtype=torch.float64) * mask
    lp = logp.clone().requires_grad_(True)
    full, _ = loss_fn(lp, old, adv, mask, **kwargs)
    full.sum().backward()
    for rank, per_rank in enumerate(pool.run(_cp_loss_worker, loss_fn, kwargs, logp, old, adv, mask)):
        for cp, (r, loss, grad) in per_rank.items():
            flip = cp == 2 and rank >= 2  # the pair's sums use only the pair's tokens
            want_loss, want_grad = (full.detach().flip(0), lp.grad.flip(0)) if flip else (full.detach(), lp.grad)
            torch.testing.assert_close(loss, _cp_shard(want_loss, cp, r), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, _cp_shard(want_grad, cp, r), rtol=1e-12, atol=1e-12)
    return logp, old, adv, mask, full.detach()


def test_gspo_sequence_ratio_under_cp(pool):
    _check_cp_loss(pool, gspo_loss, dict(clip_low=3e-3, clip_high=4e-3), seed=13, noise=0.01)


FIPO_CP = dict(tau=4.0, weight_clip=(0.8, 1.5), chunk_size=4)


def test_fipo_loss_under_cp_carries_the_future_kl_across_shards(pool):
    # The Future-KL sum of a token reaches into later CP shards (its future): the loss of each shard, and
    # its gradient, equal the unsharded loss's share only when the carry crosses ranks (cp_group).
    logp, old, adv, mask, full = _check_cp_loss(pool, fipo_policy_loss, FIPO_CP, seed=17, noise=0.05)
    local, _ = fipo_policy_loss(*(_cp_shard(x, 2, 0) for x in (logp, old, adv, mask)), **FIPO_CP)
    assert not torch.allclose(local, _cp_shard(full, 2, 0))  # without the carry it differs
