"""CPU tests of the rollout-vs-trainer mismatch metrics, float64 loop references."""
import math

import pytest
import torch

from megatron_credit.rollout.mismatch import logprob_mismatch
from tests.references import engine_trainer_logprobs as _inputs


def test_logprob_mismatch_matches_loop_reference():
    engine, trainer, mask = _inputs()
    out = logprob_mismatch(engine, trainer, mask)
    diffs, k3s, seq_k1, seq_k3 = [], [], [], []
    for b in range(engine.shape[0]):
        d_seq, k3_seq = [], []
        for t in range(engine.shape[1]):
            if mask[b, t]:
                d = trainer[b, t].item() - engine[b, t].item()
                d_seq.append(d)
                k3_seq.append(math.exp(d) - 1 - d)
        diffs += d_seq
        k3s += k3_seq
        seq_k1.append(-sum(d_seq) / len(d_seq) if d_seq else 0.0)
        seq_k3.append(sum(k3_seq) / len(k3_seq) if k3_seq else 0.0)
    assert out["mean_abs_diff"].item() == pytest.approx(sum(abs(d) for d in diffs) / len(diffs), abs=1e-12)
    assert out["max_abs_diff"].item() == pytest.approx(max(abs(d) for d in diffs), abs=1e-12)
    assert out["kl_k3"].item() == pytest.approx(sum(k3s) / len(k3s), abs=1e-12)
    torch.testing.assert_close(out["seq_kl_k1"], torch.tensor(seq_k1, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(out["seq_kl_k3"], torch.tensor(seq_k3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (out["seq_kl_k3"] >= 0).all()
    assert all(v.requires_grad is False for v in out.values())


def test_logprob_mismatch_is_zero_for_identical_inputs_and_empty_masks():
    engine, _, mask = _inputs(1)
    out = logprob_mismatch(engine, engine.clone(), mask)
    assert all(torch.all(v == 0) for v in out.values())
    out = logprob_mismatch(engine, engine + 1, torch.zeros_like(mask))
    assert all(torch.all(v == 0) for v in out.values())


def test_mismatch_of_one_token_extreme_ratios_and_an_empty_batch():
    engine = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    one = logprob_mismatch(engine, engine + 0.5, torch.tensor([[False, True, False]]))
    assert float(one["mean_abs_diff"]) == 0.5 and float(one["seq_kl_k1"][0]) == -0.5  # divided by 1 token
    assert float(one["kl_k3"]) == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-12)
    # log-ratios beyond +-20 are clamped at +-20 (k3 stays finite at any distance)
    far = logprob_mismatch(engine, engine + torch.tensor([[50.0, -50.0, 0.0]], dtype=torch.float64),
                           torch.ones(1, 3, dtype=torch.bool))
    assert float(far["max_abs_diff"]) == 20.0 and float(far["mean_abs_diff"]) == pytest.approx(40.0 / 3)
    want_k3 = (math.expm1(20.0) - 20.0 + math.expm1(-20.0) + 20.0) / 3
    assert float(far["kl_k3"]) == pytest.approx(want_k3, rel=1e-12)
    empty = logprob_mismatch(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert float(empty["max_abs_diff"]) == 0.0 and float(empty["mean_abs_diff"]) == 0.0
    assert empty["seq_kl_k1"].shape == (0,)
