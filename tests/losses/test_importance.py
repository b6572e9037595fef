"""CPU tests of the truncated importance-sampling weights (``losses/importance.py``), float64 loop references."""
import math

import pytest
import torch

from megatron_credit.losses.importance import truncated_is_weights
from tests.references import engine_trainer_logprobs as _inputs


def test_truncated_is_weights_match_loop_reference():
    engine, trainer, mask = _inputs(2)
    trainer = trainer.clone()
    trainer[0, :3] = engine[0, :3] + torch.tensor([2.0, 50.0, 1000.0], dtype=torch.float64)  # huge ratios
    mask[0, :3] = True
    cap = 2.0
    w, metrics = truncated_is_weights(trainer, engine, mask, cap=cap)
    want = torch.zeros_like(w)
    capped = 0
    for b in range(w.shape[0]):
        for t in range(w.shape[1]):
            if mask[b, t]:
                ratio = math.exp(min(trainer[b, t].item() - engine[b, t].item(), 700.0))
                want[b, t] = min(ratio, cap)
                capped += ratio > cap
    torch.testing.assert_close(w, want, rtol=0, atol=1e-12)
    assert torch.isfinite(w).all()
    n = int(mask.sum())
    assert metrics["tis_mean_weight"].item() == pytest.approx(want.sum().item() / n, abs=1e-12)
    assert metrics["tis_capped_frac"].item() == pytest.approx(capped / n, abs=1e-12)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(trainer, engine, mask, cap=0.0)


def test_truncated_is_weights_are_detached():
    engine, trainer, mask = _inputs(3)
    trainer = trainer.clone().requires_grad_(True)
    w, _ = truncated_is_weights(trainer, engine, mask, cap=2.0)
    assert not w.requires_grad


def test_truncated_is_weights_ignore_nan_padding():
    old = torch.tensor([[0.0, math.nan, -math.inf]])
    new = torch.tensor([[-0.5, 0.0, math.nan]])
    mask = torch.tensor([[True, False, False]])
    w, m = truncated_is_weights(old, new, mask, cap=2.0)
    want = torch.exp(torch.tensor(0.5))  # float32
    assert torch.equal(w, torch.stack([want, torch.tensor(0.0), torch.tensor(0.0)])[None])
    assert torch.equal(m["tis_mean_weight"], want) and float(m["tis_capped_frac"]) == 0.0
