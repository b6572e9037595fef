"""Observations are context, not actions: a multi-turn trajectory's environment tokens are out of
``loss_mask`` (so out of every loss term, the entropy, the KL, the mismatch and the token counts), carried as
``obs_mask`` / ``turn_ids`` through the batch, the micro-batches (padded and packed, CP-split), and the policy
losses of every algorithm ignore whatever sits at them (garbage log-probs and advantages change nothing, their
gradient is 0)."""
import pytest
import torch

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.batch.train_batch import (make_microbatch, make_packed_microbatch, step_denominators,
                                               train_batch_from_rollout)
from megatron_credit.credit.future_kl import pass_observations
from megatron_credit.losses.kl import KL_ESTIMATORS
from megatron_credit.rollout.mismatch import logprob_mismatch
from megatron_credit.rollout.types import Episode, FinishStatus, RolloutBatch, RolloutSample
from tests.credit.test_multi_turn_credit import trajectories


def _sample(prompt, parts, group):
    """A trajectory from ``[(ids, is_action), ...]`` turns and observations."""
    ids, act, turns, turn = [], [], [], 0
    for k, (piece, action) in enumerate(parts):
        ids += piece
        act += [action] * len(piece)
        turns += [turn] * len(piece)
        turn += 0 if action else 1
    lp = torch.tensor([-0.5 if a else 0.0 for a in act])
    return RolloutSample(prompt_ids=prompt, response_ids=ids, logprobs=lp, status=FinishStatus.STOPPED,
                         group_id=group, sample_index=0, logprobs_mode="raw",
                         action_mask=torch.tensor(act), turn_ids=torch.tensor(turns, dtype=torch.int16),
                         episode=Episode(turn_rewards=(0.25,) * (turn + 1), tool_calls=turn))


def _batch():
    samples = [_sample([5, 6], [([7, 8], True), ([30, 31, 32], False), ([9, 3], True)], 0),
               _sample([5], [([7, 3], True)], 0),
               _sample([5, 6, 6], [([7], True), ([30], False), ([8, 8, 8], True), ([31, 32], False)], 1)]
    padded = RolloutBatch(samples=samples).to_padded(pad_token_id=0)
    return train_batch_from_rollout(padded, rewards=torch.tensor([1.0, 0.0, 0.5]), correct=torch.tensor([1, 0, 1]),
                                    pad_id=0), padded


def test_the_batch_carries_observations_apart_from_the_loss_mask():
    batch, padded = _batch()
    assert not (batch.loss_mask & batch.obs_mask).any()
    # label space: position t scores token t + 1; row 0 = [5 6 | 7 8 | 30 31 32 | 9 3]
    assert batch.loss_mask[0].tolist() == [False, True, True, False, False, False, True, True, False, False]
    assert batch.obs_mask[0].tolist() == [False, False, False, True, True, True, False, False, False, False]
    assert batch.turn_ids[0].tolist() == [-1, 0, 0, 0, 0, 0, 1, 1, -1, -1]
    assert batch.loss_mask.sum() == 2 + 2 + 2 + 1 + 3  # the policy's tokens only
    assert step_denominators(batch.loss_mask, norm_length=10, device=torch.device("cpu")).global_num_tokens == 10
    assert batch.turn_rewards.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]


@pytest.mark.parametrize("cp", [1, 2])
def test_micro_batches_cut_and_pack_the_observation_fields(cp):
    batch, _ = _batch()
    for r in range(cp):
        mb = make_microbatch(batch, [0, 2], seq_len=12, num_rows=2, pad_id=0, device=torch.device("cpu"),
                             cp_size=cp, cp_rank=r)
        assert mb.tensors["obs_mask"].dtype == torch.bool and mb.tensors["turn_ids"].dtype == torch.long
        assert not (mb.tensors["obs_mask"] & mb.tensors["loss_mask"]).any()
        whole = mb.whole_rows(mb.tensors["turn_ids"]) if cp == 1 else None
        if whole is not None:
            assert whole[:, :10].tolist() == batch.turn_ids[[0, 2]].tolist() and (whole[:, 10:] == -1).all()
        packed = make_packed_microbatch(batch, [0, 1, 2], multiple=2 * cp, pad_id=0, device=torch.device("cpu"),
                                        cp_size=cp, cp_rank=r)
        rows = packed.rows_view(packed.tensors["obs_mask"], False)
        assert rows.sum() <= batch.obs_mask.sum() and not (rows & packed.rows_view(packed.tensors["loss_mask"], False)).any()
        if cp == 1:
            assert int(rows.sum()) == int(batch.obs_mask.sum())


def _loss(alg, logp, old, adv, mask, obs, den):
    side = {k: torch.zeros_like(old) for k in alg.side_channels}
    per_tok, _ = alg.loss(logp, old, adv, mask, row_slots=pass_observations(None, obs), **side)
    return alg.aggregate(per_tok, mask, **den.for_rows(mask))


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_no_loss_reads_an_observation(name):
    alg = ALGORITHMS.get(name).from_mapping({}).build()
    mask, obs, _ = trajectories(6, 30, 3)
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 30, generator=g, dtype=torch.float64) * 0.3 - 1
    logp0 = old + torch.randn(6, 30, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(6, 30, generator=g, dtype=torch.float64)
    den = step_denominators(mask, norm_length=30, device=torch.device("cpu"))
    logp = logp0.clone().requires_grad_(True)
    clean = _loss(alg, logp, old, adv, mask, obs, den)
    clean.backward()
    assert torch.isfinite(clean) and (logp.grad[obs] == 0).all() and logp.grad[mask].abs().sum() > 0
    noise = torch.randn(6, 30, generator=g, dtype=torch.float64) * 50
    dirty = _loss(alg, torch.where(obs, logp0 + noise, logp0), torch.where(obs, old - noise, old),
                  torch.where(obs, noise, adv), mask, obs, den)
    torch.testing.assert_close(dirty, clean.detach(), rtol=1e-12, atol=1e-12)


def test_kl_entropy_and_mismatch_read_the_mask():
    mask, obs, _ = trajectories(4, 25, 8)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 25, generator=g), torch.randn(4, 25, generator=g)
    noise = torch.randn(4, 25, generator=g) * 40
    mm = logprob_mismatch(a, b, mask)
    mm2 = logprob_mismatch(torch.where(obs, a + noise, a), b, mask)
    assert all(torch.equal(mm[k], mm2[k]) for k in mm)
    kl = KL_ESTIMATORS.get("k3")
    assert torch.equal(torch.where(mask, kl(a, b), 0.0).sum(), torch.where(mask, kl(torch.where(obs, noise, a), b), 0.0).sum())
