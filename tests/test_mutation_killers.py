"""Behavioural tests that a mutation run (issue 14) showed were missing: each one fails if the named
rule of the code is changed, and says why that rule matters to a user.

- FIPO: a token whose ratio equals ``c`` *exactly* is in ``M`` (``d <= log c``) and is not capped at
  ``ratio == safety_thresh`` (``>``); metrics and the multi-dual-clip filter use the same boundaries.
- Policy losses: advantages (and truncated-IS weights) that carry a gradient (a critic's output) give
  no gradient to their producer, and the policy gradient is that of the detached advantages.
- DAPO verifier: commas that carry meaning (signed lists, tuples, intervals, sets) are kept; only
  a thousands separator in a plain digit string is dropped.
- math-verify: symbolic answers are read as math whatever their spacing.

Conversion weights that must all be distinct live in ``tests/test_conversion_unique_weights.py``.
"""
import math

import pytest
import torch

from megatron_credit.credit.future_kl import fipo_weights, future_kl, multi_dual_clip_keep
from megatron_credit.losses.policy import fipo_policy_loss, gspo_loss, ppo_clip_loss
from megatron_credit.rewards.dapo import normalize_final_answer, score_dapo
from megatron_credit.rewards.math import compute_score


# --- FIPO boundaries: ratio == c exactly ---------------------------------------------------------
def _at_ratio(ratio: float, *, n: int = 4, at: int = 2):
    """One row of ``n`` tokens with ``logp - old_logp = log(ratio)`` exactly at ``at``, 0 elsewhere."""
    logp = torch.zeros(1, n, dtype=torch.float64)
    logp[0, at] = math.log(ratio)
    old = torch.zeros_like(logp)  # logp - 0 is exact: the token's log-ratio *is* log(ratio)
    return logp, old, torch.ones(1, n, dtype=torch.bool)


@pytest.mark.parametrize("c", [3.0, 10.0])
def test_token_at_ratio_exactly_c_stays_in_future_sums(c):
    """DESIGN.md: ``M_k = [d_k <= log c]``: the boundary token brings its evidence to every earlier
    token; one just above ``c`` brings none."""
    tau = 4.0
    gamma = 2.0 ** (-1.0 / tau)
    logp, old, mask = _at_ratio(c)
    f = future_kl(logp, old, mask, tau=tau, dual_clip_c=c)
    d = math.log(c)
    want = torch.tensor([[gamma ** 2 * d, gamma * d, d, 0.0]], dtype=torch.float64)
    assert torch.allclose(f, want, rtol=1e-12, atol=0), f
    above = future_kl(*_at_ratio(c * (1 + 1e-9)), tau=tau, dual_clip_c=c)
    assert torch.equal(above, torch.zeros_like(above)), above


def test_boundary_token_weights_and_metrics():
    """At ratio == c the future KL raises the earlier tokens' weights; the token is not reported as
    dual-masked, and an ``A < 0`` token at exactly ``safety_thresh`` is not capped (cap: ratio > s)."""
    c = 3.0
    logp, old, mask = _at_ratio(c)
    adv = -torch.ones(1, 4, dtype=torch.float64)
    w, m = fipo_weights(logp, old, adv, mask, tau=4.0, clip=(1.0, 1.2), dual_clip_c=c)
    assert (w[0, :3] > 1.0).all(), w  # exp(F) > 1 before and at the boundary token, not capped
    assert w[0, 3] == 1.0
    assert float(m["frac_dual_masked"]) == 0.0 and float(m["frac_dual_capped"]) == 0.0
    lp_above, old_above, _ = _at_ratio(c * (1 + 1e-9))
    w_above, m_above = fipo_weights(lp_above, old_above, adv, mask, tau=4.0, clip=(1.0, 1.2), dual_clip_c=c)
    assert torch.equal(w_above, torch.ones_like(w_above)), w_above
    assert float(m_above["frac_dual_masked"]) == 0.25 and float(m_above["frac_dual_capped"]) == 0.25
    # A separate safety threshold at the boundary: the A < 0 token at ratio == s keeps its weight > 1.
    s = 2.0
    logp, old, mask = _at_ratio(s)
    w, m = fipo_weights(logp, old, adv, mask, tau=4.0, clip=(1.0, 1.2), dual_clip_c=c, safety_thresh=s)
    assert w[0, 2] > 1.0 and float(m["frac_dual_capped"]) == 0.0, (w, m)


def test_multi_dual_clip_keep_boundaries():
    """A token at ratio == c is not dual-clipped; exactly ``max_dual_clipped`` clipped tokens are kept."""
    c = 3.0
    n = 4
    logp = torch.zeros(3, n, dtype=torch.float64)
    logp[0, :] = math.log(c)               # every token exactly at c: none is dual-clipped
    logp[1, :2] = math.log(c) + 1e-6       # two above c with A < 0: dropped at max 1, kept at max 2
    logp[2, 0] = math.log(c) + 1e-6        # one above c: kept at max 1
    old = torch.zeros_like(logp)
    adv = -torch.ones_like(logp)
    mask = torch.ones(3, n, dtype=torch.bool)
    keep = multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=c)
    assert keep.tolist() == [True, False, True]
    keep2 = multi_dual_clip_keep(logp, old, adv, mask, dual_clip_c=c, max_dual_clipped=2)
    assert keep2.tolist() == [True, True, True]
    # Positive advantages above c are handled by the ordinary clip, not counted here.
    assert multi_dual_clip_keep(logp, old, -adv, mask, dual_clip_c=c).tolist() == [True, True, True]


# --- policy losses: advantages that carry a gradient ---------------------------------------------
def _loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    logp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4)
    mask = torch.rand(b, t, generator=g) > 0.2
    critic_out = torch.randn(b, t, generator=g, dtype=torch.float64)
    return logp, old, mask, critic_out


LOSSES = {
    "ppo": lambda lp, old, adv, m, **kw: ppo_clip_loss(lp, old, adv, m, **kw),
    "fipo": lambda lp, old, adv, m, **kw: fipo_policy_loss(lp, old, adv, m, tau=2.0, dual_clip_c=3.0,
                                                             weight_clip=(0.8, 1.2), **kw),
    "gspo": lambda lp, old, adv, m, **kw: gspo_loss(lp, old, adv, m, clip_low=0.1, clip_high=0.1, **kw),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_advantages_with_grad_are_detached_in_the_loss(name):
    """A critic's advantages (``A = G - V(s)``, with grad) must not receive a policy-loss gradient, and
    the gradient w.r.t. logp equals that computed with the detached advantages."""
    logp, old, mask, critic_out = _loss_inputs()
    values = critic_out.clone().requires_grad_(True)  # a critic's output
    adv = 1.0 - values  # advantages that carry a gradient to the critic
    lp = logp.clone().requires_grad_(True)
    loss, _ = LOSSES[name](lp, old, adv, mask)
    loss.sum().backward()
    assert values.grad is None, "the policy loss sent a gradient into the advantages' producer"
    lp_ref = logp.clone().requires_grad_(True)
    loss_ref, _ = LOSSES[name](lp_ref, old, (1.0 - critic_out).detach(), mask)
    loss_ref.sum().backward()
    assert torch.equal(loss.detach(), loss_ref.detach())
    assert torch.allclose(lp.grad, lp_ref.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_is_weights_with_grad_are_detached_in_the_loss(name):
    """Truncated-IS weights are constants of the loss, even if a caller built them with grad."""
    logp, old, mask, critic_out = _loss_inputs(1)
    src = (critic_out * 0.1).clone().requires_grad_(True)
    is_w = torch.exp(src).clamp(max=2.0)
    lp = logp.clone().requires_grad_(True)
    loss, _ = LOSSES[name](lp, old, torch.ones_like(old), mask, is_weights=is_w)
    loss.sum().backward()
    assert src.grad is None


# --- DAPO verifier: commas that matter -----------------------------------------------------------
@pytest.mark.parametrize("pred,gt", [
    ("-12", "-1,2"),          # a signed list is not a number with a thousands separator
    ("-1,2", "-12"),
    ("(12)", "(1,2)"),        # tuple / point
    ("(1,2)", "(12)"),
    ("[13)", "[1,3)"),        # interval
    ("[1,3)", "[13)"),
    ("\\{12\\}", "\\{1,2\\}"),  # set
    ("x,y", "xy"),
    ("1.5", "1,5"),           # a decimal comma is not a thousands separator either
    ("-1234", "-1,2,3,4"),
])
def test_dapo_keeps_commas_that_carry_meaning(pred, gt):
    assert not score_dapo(f"Answer: {pred}", gt).correct
    assert score_dapo(f"Answer: {gt}", gt).correct


@pytest.mark.parametrize("text,want", [
    ("1,234", "1234"), ("1,234,567", "1234567"), ("-1,2", "-1,2"), ("(1, 2)", "(1,2)"),
    ("[1, 3)", "[1,3)"), ("1,2.5", "1,2.5"), ("a,b", "a,b"),
])
def test_dapo_normalisation_drops_only_thousands_separators(text, want):
    assert normalize_final_answer(text) == want


# --- math-verify: symbolic answers ---------------------------------------------------------------
@pytest.mark.parametrize("pred,gt,ok", [
    ("x + 1", "x+1", True),
    ("x+1", "x + 1", True),
    ("1 + x", "x+1", True),
    ("2 x + 1", "2x+1", True),
    ("\\frac{x}{2}", "x/2", True),
    ("x^2 + 2x + 1", "(x+1)^2", True),
    ("a + b", "a+b", True),
    ("x + 2", "x+1", False),
    ("y + 1", "x+1", False),
])
def test_math_verify_reads_symbolic_answer_lines_as_math(pred, gt, ok):
    """An ``Answer:`` line whose symbols are all in the ground truth is math, not prose (the prose
    fallback is for symbols the ground truth lacks, e.g. ``it is 12`` read as ``12 i^2 s t``)."""
    assert compute_score(f"Answer: {pred}", gt, method="math_verify").correct is ok
