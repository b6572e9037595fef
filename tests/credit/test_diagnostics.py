"""The credit diagnostics (``credit/diagnostics.py``) against the loop reference, on hand-made advantages."""
from __future__ import annotations

import pytest
import torch

from megatron_credit.credit.diagnostics import advantage_sums, credit_sums, per_response, turn_sums
from tests.references import credit_diagnostics_reference


def _check(adv, mask):
    got, ref = per_response(adv, mask), credit_diagnostics_reference(adv, mask)
    for i, r in enumerate(ref):
        assert bool(got["has_credit"][i]) == (r is not None)
        if r is not None:
            for k, v in r.items():
                assert float(got[k][i]) == pytest.approx(v, abs=1e-12), (i, k)
    return got


def test_grpo_flat_credit_has_gini_zero_and_every_token_effective():
    # GRPO: one advantage broadcast to each response's tokens, of any sign and length (right-padded)
    adv = torch.tensor([[0.7] * 5 + [0.0] * 3, [-1.3] * 8, [2.0] * 1 + [0.0] * 7])
    mask = adv != 0
    got = _check(adv, mask)
    assert got["gini"].tolist() == pytest.approx([0.0] * 3, abs=1e-12)
    assert got["effective_frac"].tolist() == pytest.approx([1.0] * 3, abs=1e-12)
    assert got["position_corr"].tolist() == [0.0] * 3


def test_hand_made_credit_matches_the_reference_and_known_values():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[0.0, 0.0, 0.0, 4.0, 9.0],     # all credit on the last token (and junk off the mask)
                        [1.0, 2.0, 3.0, 4.0, 5.0],     # credit growing with position
                        [9.0, -1.0, 1.0, 9.0, -2.0],   # a mask with holes: the valid tokens only
                        [0.0, 0.0, 0.0, 0.0, 0.0]])    # no credit
    got = _check(adv, mask)
    assert float(got["gini"][0]) == pytest.approx(0.75) and float(got["effective_frac"][0]) == pytest.approx(0.25)
    assert float(got["position_corr"][1]) == pytest.approx(1.0)
    # x = 1, 2, 3, 4, 5: Gini = sum_{i,j} |i - j| / (2 * 5 * 15) = 40 / 150
    assert float(got["gini"][1]) == pytest.approx(40 / 150)
    assert not bool(got["has_credit"][3]) and float(got["gini"][3]) == 0.0


def test_random_credit_matches_the_reference_and_sums_average_responses_with_credit():
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(12, 17, generator=g, dtype=torch.float64) * torch.rand(12, 1, generator=g, dtype=torch.float64)
    mask = torch.rand(12, 17, generator=g) < 0.7
    adv[4] = 0.0  # a response without credit is left out of the means
    got = _check(adv, mask)
    sums, ref = credit_sums(adv, mask), [r for r in credit_diagnostics_reference(adv, mask) if r is not None]
    assert float(sums["sum:credit/responses"]) == len(ref) == 11
    for k in ("gini", "effective_frac", "position_corr"):
        assert float(sums[f"sum:credit/{k}"]) == pytest.approx(sum(r[k] for r in ref), abs=1e-10)
    assert got["gini"].dtype == torch.float64


def test_the_metric_table_turns_the_sums_into_credit_metrics_and_omits_them_without_credit():
    from megatron_credit.metrics.sums import StatSums, finalize

    adv = torch.tensor([[0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
    stats = StatSums()
    stats.add(credit_sums(adv, torch.ones(2, 3, dtype=torch.bool)))
    out = finalize(stats, ())
    assert out["credit/weight_gini"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["credit/effective_token_frac"] == pytest.approx((1 / 3 + 1) / 2)
    assert out["credit/position_corr"] == pytest.approx((3 ** 0.5 / 2 + 0) / 2)
    empty = StatSums()
    empty.add(credit_sums(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)))
    assert not any(k.startswith("credit/") for k in finalize(empty, ()))  # absent, never a 0


def test_advantage_sums_are_the_credit_sums_and_with_turns_the_turn_sums():
    adv = torch.tensor([[0.0, 2.0, -3.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    turns = torch.tensor([[0, 1, 1], [0, 0, 9]])
    alone, with_turns = credit_sums(adv, mask), {**credit_sums(adv, mask), **turn_sums(adv, mask, turns)}
    for got, want in ((advantage_sums(adv, mask), alone), (advantage_sums(adv, mask, turns), with_turns)):
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want)

