"""Credit across turns (docs/multi_turn.md): GAE, Comp-GAE and FIPO's Future-KL on trajectories that
interleave the policy's tokens with environment observations, against the plain statement of the
definition (observations taken out, the single-turn loop reference on the action tokens side by side); the
group estimators' trajectory return on every action token; turn rewards at each turn's last action token;
and the invariance: changing an observation's tokens changes no action token's advantage."""
import pytest
import torch

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.algorithm.base import AdvantageInputs
from megatron_credit.batch.train_batch import TrainBatch
from megatron_credit.credit.future_kl import fipo_weights, future_kl
from megatron_credit.credit.gae import comp_gae, gae
from tests.references import (comp_gae_reference, fipo_weights_reference, future_kl_reference, gae_reference,
                              group_advantages_reference, without_observations)


def trajectories(b, t, seed, *, obs_lens=None):
    """Rows of [prompt][turn 0][obs 0][turn 1][obs 1]...[padding]; returns (mask, obs, turn_ids)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    obs = torch.zeros(b, t, dtype=torch.bool)
    turns = torch.full((b, t), -1, dtype=torch.long)
    for i in range(b):
        at = int(torch.randint(1, 4, (1,), generator=g))
        k = 0
        while at < t - 1:
            n = int(torch.randint(1, 6, (1,), generator=g))
            mask[i, at:at + n] = True
            turns[i, at:at + n] = k
            at += n
            o = obs_lens[i][k] if obs_lens is not None and k < len(obs_lens[i]) else int(torch.randint(1, 5, (1,), generator=g))
            if at >= t - 1 or torch.rand(1, generator=g) < 0.25:
                break
            obs[i, at:at + o] = True
            turns[i, at:at + o] = k
            at += o
            k += 1
        mask[i, t - 1:] = False
        obs[i, t - 1:] = False
    return mask, obs, turns


def randn(b, t, seed):
    return torch.randn(b, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.5)])
def test_gae_passes_across_observations(seed, gamma, lam):
    mask, obs, _ = trajectories(6, 48, seed)
    r, v = randn(6, 48, seed) * mask, randn(6, 48, seed + 100)
    v = torch.where(obs, torch.nan, v)  # an observation's value is never read
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam, obs_mask=obs, chunk_size=8)
    ref_adv, ref_ret = without_observations(lambda r, v, m: gae_reference(r, v, m, gamma, lam), mask, obs,
                                            r, torch.nan_to_num(v))
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    assert (adv[obs] == 0).all() and (ret[obs] == 0).all()


@pytest.mark.parametrize("seed", [3, 4])
def test_comp_gae_passes_across_observations(seed):
    mask, obs, _ = trajectories(5, 64, seed)
    r, v = randn(5, 64, seed) * mask, randn(5, 64, seed + 1)
    kappa = torch.rand(5, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kappa = torch.where(obs, 123.0, kappa)  # the gate is read at action tokens only
    adv, ret = comp_gae(r, v, kappa, mask, lam=0.9, obs_mask=obs, chunk_size=16)
    ref_adv, ref_ret = without_observations(lambda r, v, k, m: comp_gae_reference(r, v, k, m, 0.9), mask, obs,
                                            r, v, kappa)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_without_obs_mask_an_observation_cuts_gae():
    """The single-turn reading of the same mask (no ``obs_mask``): each action run is its own response. The
    multi-turn batch must pass ``obs_mask``, or turn 0 never sees turn 1's reward."""
    mask = torch.tensor([[False, True, True, False, False, True]])
    obs = torch.tensor([[False, False, False, True, True, False]])
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.zeros(1, 6, dtype=torch.float64)
    cut, _ = gae(r, v, mask, gamma=1.0, lam=1.0)
    across, _ = gae(r, v, mask, gamma=1.0, lam=1.0, obs_mask=obs)
    assert cut[0].tolist() == [0, 0, 0, 0, 0, 1]
    assert across[0].tolist() == [0, 1, 1, 0, 0, 1]
    half, _ = gae(r, v, mask, gamma=0.5, lam=1.0, obs_mask=obs)  # one discount step across the observation
    assert half[0].tolist() == [0, 0.25, 0.5, 0, 0, 1]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", [5, 6])
def test_future_kl_runs_through_later_turns_and_decays_over_actions_only(packed, seed):
    mask, obs, _ = trajectories(6, 50, seed)
    logp, old = randn(6, 50, seed) * 0.3, randn(6, 50, seed + 7) * 0.3
    logp = torch.where(obs, torch.nan, logp)  # an observation's log-prob is never read
    got = future_kl(logp, old, mask, tau=4.0, dual_clip_c=3.0, obs_mask=obs, packed=packed, chunk_size=8)
    ref = without_observations(lambda a, b, m: future_kl_reference(a, b, m, tau=4.0, c=3.0, packed=packed),
                               mask, obs, torch.nan_to_num(logp), old)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    adv = randn(6, 50, seed + 9)
    w, _ = fipo_weights(logp, old, adv, mask, tau=4.0, clip=(0.8, 1.2), dual_clip_c=3.0, obs_mask=obs, packed=packed)
    ref_w = without_observations(lambda a, b, c, m: fipo_weights_reference(a, b, c, m, tau=4.0, clip=(0.8, 1.2),
                                                                           c=3.0, packed=packed),
                                 mask, obs, torch.nan_to_num(logp), old, adv)
    torch.testing.assert_close(torch.where(mask, w, 0.0), ref_w, rtol=1e-12, atol=1e-12)


def _lengthen_observations(mask, obs, tensors, extra):
    """The same rows with each observation ``extra`` tokens longer (filled with noise): the action tokens and
    their values unchanged."""
    b, t = mask.shape
    new_t = t + extra * int(obs.sum(1).gt(0).sum() + 10)
    out_mask = torch.zeros(b, new_t, dtype=torch.bool)
    out_obs = torch.zeros(b, new_t, dtype=torch.bool)
    outs = [torch.randn(b, new_t, dtype=torch.float64) for _ in tensors]
    for i in range(b):
        j = 0
        for s in range(t):
            copies = 1 + (extra if obs[i, s] and (s + 1 == t or not obs[i, s + 1]) else 0)
            for _ in range(copies):
                out_mask[i, j], out_obs[i, j] = mask[i, s], obs[i, s]
                for o, x in zip(outs, tensors):
                    o[i, j] = x[i, s] if not obs[i, s] else torch.randn(())
                j += 1
    return out_mask, out_obs, outs


def test_changing_observations_changes_no_action_advantage():
    """Every estimator's action-token advantages are a function of the action tokens' own inputs alone: longer
    observations with other contents leave them as they were (the definition: observations are transparent;
    a critic's values or a CompPO gate would move only through what they read from the observation, which
    this holds fixed)."""
    mask, obs, _ = trajectories(6, 40, 11)
    r, v, lp, old = randn(6, 40, 1) * mask, randn(6, 40, 2), randn(6, 40, 3) * 0.2, randn(6, 40, 4) * 0.2
    kappa = torch.rand(6, 40, dtype=torch.float64)
    m2, o2, (r2, v2, lp2, old2, k2) = _lengthen_observations(mask, obs, (r, v, lp, old, kappa), extra=3)
    r2 = torch.where(m2, r2, 0.0)
    assert o2.sum() > obs.sum() and m2.sum() == mask.sum()
    for f in (lambda r, v, k, m, o: gae(r, v, m, gamma=0.9, lam=0.8, obs_mask=o)[0],
              lambda r, v, k, m, o: comp_gae(r, v, k, m, lam=0.8, obs_mask=o)[0]):
        a1, a2 = f(r, v, kappa, mask, obs), f(r2, v2, k2, m2, o2)
        torch.testing.assert_close(a1[mask], a2[m2], rtol=1e-12, atol=1e-12)
    f1 = future_kl(lp, old, mask, tau=8.0, dual_clip_c=10.0, obs_mask=obs)
    f2 = future_kl(lp2, old2, m2, tau=8.0, dual_clip_c=10.0, obs_mask=o2)
    torch.testing.assert_close(f1[mask], f2[m2], rtol=1e-12, atol=1e-12)
    # without the definition (the scan counting observation positions) the Future-KL would change
    f3 = future_kl(lp2, old2, m2, tau=8.0, dual_clip_c=10.0)
    assert not torch.allclose(f1[mask], f3[m2])


@pytest.mark.parametrize("name,kind", [("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("rloo", "rloo")])
def test_group_estimators_give_the_trajectory_return_to_every_action_token(name, kind):
    mask, obs, _ = trajectories(8, 30, 21)
    scores = torch.randn(8, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    alg = ALGORITHMS.get(name).from_mapping({}).build()
    out = alg.estimate(AdvantageInputs(response_mask=mask, scores=scores, group_ids=ids, obs_mask=obs))
    ref = group_advantages_reference(scores, ids, kind)
    want = torch.where(mask, ref[:, None].expand(8, 30), 0.0)
    torch.testing.assert_close(out.advantages.double(), want, rtol=1e-6, atol=1e-6)
    assert (out.advantages[obs] == 0).all()


def test_turn_rewards_enter_at_each_turns_last_action_token():
    # label space: [p p a a o o a a a o a pad]
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
    obs = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    turns = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, -1, -1]])
    batch = TrainBatch(input_ids=torch.zeros(1, 12, dtype=torch.long), labels=torch.zeros(1, 12, dtype=torch.long),
                       loss_mask=mask, rollout_logp=torch.zeros(1, 12), seq_lens=torch.tensor([11]),
                       group_ids=torch.tensor([0]), rewards=torch.tensor([1.75]), correct=torch.tensor([True]),
                       obs_mask=obs, turn_ids=turns, turn_rewards=torch.tensor([[0.25, 0.5, 0.0]]))
    got = batch.token_rewards()
    want = torch.zeros(1, 12)
    want[0, 2], want[0, 7], want[0, 9] = 0.25, 0.5, 1.0  # the verifier's 1.0 = 1.75 - 0.25 - 0.5, at the end
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------- context parallel (gloo)

from tests.support.distributed_harness import block_subgroup, load_balanced_shard  # noqa: E402
from tests.support.threaded_harness import gloo_and_threads_pool  # noqa: E402

pool = gloo_and_threads_pool(4)  # [gloo] spawned workers, [threads] ranks as threads


def _cp_worker(cases):
    groups = {cp: block_subgroup(cp) for cp in (2, 4)}
    out = []
    for r, v, kappa, lp, old, mask, obs in cases:
        for cp, (g, rank) in groups.items():
            sh = lambda x: load_balanced_shard(x, cp, rank)  # noqa: E731
            adv, ret = comp_gae(sh(r), sh(v), sh(kappa), sh(mask), lam=0.9, obs_mask=sh(obs), chunk_size=4,
                                cp_group=g)
            f = future_kl(sh(lp), sh(old), sh(mask), tau=4.0, dual_clip_c=3.0, obs_mask=sh(obs), chunk_size=4,
                          cp_group=g)
            out.append((cp, rank, adv, ret, f))
    return out


def test_multi_turn_scans_under_cp_2_and_4_equal_unsharded(pool):
    """An observation (and the next action's value across it) at a CP chunk boundary: the sharded scans equal
    the whole sequence's."""
    cases = []
    for seed, t in enumerate([16, 48, 128]):
        mask, obs, _ = trajectories(4, t, 40 + seed)
        r, v = randn(4, t, seed) * mask, randn(4, t, seed + 1)
        kappa = torch.rand(4, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        lp, old = randn(4, t, seed + 2) * 0.3, randn(4, t, seed + 3) * 0.3
        cases.append((r, v, kappa, lp, old, mask, obs))
    for rank_results in pool.run(_cp_worker, cases):
        it = iter(rank_results)
        for r, v, kappa, lp, old, mask, obs in cases:
            ref_adv, ref_ret = comp_gae(r, v, kappa, mask, lam=0.9, obs_mask=obs)
            ref_f = future_kl(lp, old, mask, tau=4.0, dual_clip_c=3.0, obs_mask=obs)
            for _ in (2, 4):
                cp, rank, adv, ret, f = next(it)
                torch.testing.assert_close(adv, load_balanced_shard(ref_adv, cp, rank), rtol=1e-11, atol=1e-11)
                torch.testing.assert_close(ret, load_balanced_shard(ref_ret, cp, rank), rtol=1e-11, atol=1e-11)
                torch.testing.assert_close(f, load_balanced_shard(ref_f, cp, rank), rtol=1e-11, atol=1e-11)
