"""Behavioural tests that a mutation run showed were missing: each one fails if the named
rule of the code is changed, and says why that rule matters to a user.

- FIPO: a token whose ratio equals ``c`` *exactly* is in ``M`` (``d <= log c``) and is not capped at
  ``ratio == safety_thresh`` (``>``); metrics and the multi-dual-clip filter use the same boundaries.
- Policy losses: advantages (and truncated-IS weights) that carry a gradient (a critic's output) give
  no gradient to their producer, and the policy gradient is that of the detached advantages.
- FIPO's loss passes every one of its settings on (safety threshold, packed rows, dual clip, IS
  weights) and scales advantages by ``f`` (not ``/ f``), checked end to end against loop references.
- Default hyperparameters are the documented ones (docs/architecture.md, GSPO's paper), on each algorithm's
  ``Config`` (what a recipe without params gets), through its loss and through the public functions
  given those values; log-ratios (GSPO's sequence ratio,
  truncated-IS weights) are clamped to [-20, 20] on both sides like every other ratio.
- Group estimators on groups of exactly two (the unbiased std and RLOO's ``n / (n - 1)`` at n = 2);
  CompPO's gate at its default tau = 4 and at the edges of its envelope (a constant gate is the
  fixed-gate ablation).
- DAPO verifier: commas that carry meaning (signed lists, tuples, intervals, sets) are kept; only
  a thousands separator in a plain digit string is dropped.
- math-verify: symbolic answers are read as math whatever their spacing.

Conversion weights that must all be distinct live in ``tests/conversion/test_unique_weights.py``.
"""
import math

import pytest
import torch

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.credit.future_kl import fipo_weights, future_kl, multi_dual_clip_keep
from megatron_credit.credit.gates import comppo_gate
from megatron_credit.credit.group import broadcast_to_tokens, dr_grpo_advantages, grpo_advantages, rloo_advantages
from megatron_credit.losses.policy import AGG_MODES, aggregate_loss
from tests.support.loss_settings import fipo_policy_loss, gspo_loss, ppo_clip_loss
from megatron_credit.rewards.dapo import normalize_final_answer, score_dapo
from megatron_credit.rewards.math import compute_score
from tests.references import (comppo_gate_reference, fipo_weights_reference, group_advantages_reference,
                              gspo_reference, ppo_reference)


# --- FIPO boundaries: ratio == c exactly ---------------------------------------------------------
def _at_ratio(ratio: float, *, n: int = 4, at: int = 2):
    """One row of ``n`` tokens with ``logp - old_logp = log(ratio)`` exactly at ``at``, 0 elsewhere."""
    logp = torch.zeros(1, n, dtype=torch.float64)
    logp[0, at] = math.log(ratio)
    old = torch.zeros_like(logp)  # logp - 0 is exact: the token's log-ratio *is* log(ratio)
    return logp, old, torch.ones(1, n, dtype=torch.bool)


@pytest.mark.parametrize("c", [3.0, 10.0])
def test_token_at_ratio_exactly_c_stays_in_future_sums(c):
    """docs/architecture.md: ``M_k = [d_k <= log c]``: the boundary token brings its evidence to every earlier
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


# --- FIPO's loss: every setting reaches the math ------------------------------------------------
def _fipo_batch(seed=0):
    """Packed rows (two responses each, split by masked prompt tokens) with log-ratios ~N(0, 0.1) and
    tokens placed where each FIPO setting decides the result: A < 0 at ratio 2.5 (capped only by a
    safety threshold of 2), at ratio 4 (dual clip 3 vs 5), at ratio 7 (inside M only if c > 7)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 24
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    d = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, 1:10] = True
    mask[:, 12:22] = True
    for i, pos, ratio, a in [(0, 3, 2.5, -1.0), (0, 14, 7.0, -0.7), (1, 5, 4.0, -1.3), (1, 13, 2.5, -0.4),
                             (2, 2, 1.4, 0.9), (2, 15, 0.7, -0.8), (2, 17, 7.0, -1.1)]:
        d[i, pos], adv[i, pos] = math.log(ratio), a
    isw = 0.5 + torch.rand(b, t, generator=g, dtype=torch.float64)
    return old + d, old, adv, mask, isw


def test_fipo_loss_forwards_every_setting_to_the_weights_and_the_clip():
    """The loss and its gradient equal DAPO on ``f * A`` with f from the loop reference, with settings
    that each change the result: a safety threshold below c, packed rows, c = 5 (not either default),
    IS weights, a weight clip below 1 and a short half-life."""
    logp, old, adv, mask, isw = _fipo_batch()
    kw = dict(tau=3.0, weight_clip=(0.8, 1.25), dual_clip_c=5.0, safety_thresh=2.0, packed=True)
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fipo_policy_loss(lp, old, adv, mask, clip_low=0.15, clip_high=0.3, is_weights=isw, **kw)
    loss.sum().backward()
    w = fipo_weights_reference(logp, old, adv, mask, tau=3.0, clip=(0.8, 1.25), c=5.0, safety=2.0, packed=True)
    ref_loss, ref_grad = ppo_reference(logp, old, adv * w, mask, el=0.15, eh=0.3, c=5.0, isw=isw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-12)
    # The cases were exercised: weights on both sides of 1, a safety cap that c alone would not give.
    assert (w[mask] < 1).any() and (w[mask] > 1).any()
    unsafe = fipo_weights_reference(logp, old, adv, mask, tau=3.0, clip=(0.8, 1.25), c=5.0, safety=None,
                                    packed=True)
    assert not torch.equal(w, unsafe)
    assert not torch.equal(w, fipo_weights_reference(logp, old, adv, mask, tau=3.0, clip=(0.8, 1.25), c=5.0,
                                                     safety=2.0, packed=False))
    # Metrics: the loss's clip fractions and the weights' summary under the fipo_weight/ prefix.
    torch.testing.assert_close(metrics["fipo_weight/mean"], w[mask].mean(), rtol=1e-12, atol=1e-12)
    d = (logp - old)[mask]
    torch.testing.assert_close(metrics["clipfrac_dual"], ((adv[mask] < 0) & (d > math.log(5.0))).double().mean())


# --- documented defaults -------------------------------------------------------------------------
def _defaults_batch(seed=1):
    """Log-ratios ~N(0, 0.01) (so exp(F) lies inside FIPO's [1, 1.2] and depends on tau), with tokens
    on the far side of each default: A > 0 at ratio 1.5 (clip_high 0.28), A < 0 at ratio 0.7 (clip_low
    0.2), at 3.5 (dual clip 3) and at 10.5 (FIPO's c = 10), early in the rows so later tokens' F is small.
    Row 0 has a masked hole inside its response (FIPO's default is one response per row, ``packed=False``)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 40
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    d = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.01
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate([40, 33, 25, 12]):
        mask[i, t - n:] = True
    mask[0, 20:23] = False  # masked tokens inside one response (e.g. tool output) do not cut F by default
    for i, pos, ratio, a in [(0, 0, 1.5, 1.0), (0, 1, 0.7, -1.0), (1, 8, 3.5, -1.0), (1, 9, 10.5, -1.0),
                             (2, 16, 10.5, -0.5), (3, 29, 1.5, 2.0)]:
        d[i, pos], adv[i, pos] = math.log(ratio), a
    return old + d, old, adv, mask


def test_policy_losses_default_to_the_documented_hyperparameters():
    """docs/architecture.md: DAPO clips at [1 - 0.2, 1 + 0.28] with dual clip c = 3 (the 7B setting); FIPO uses
    c = 10, tau = 32, f in [1.0, 1.2] and the same asymmetric clip; GSPO-token 3e-4 / 4e-4 (its
    paper). With a default config (no ``algorithm.params``), each algorithm's loss must equal its loop
    reference at those values."""
    default = lambda name: ALGORITHMS.get(name)().build().loss  # noqa: E731
    logp, old, adv, mask = _defaults_batch()
    loss, _ = default("dapo")(logp, old, adv, mask)
    ref, _ = ppo_reference(logp, old, adv, mask, el=0.2, eh=0.28, c=3.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)

    loss, _ = default("fipo")(logp, old, adv, mask)
    w = fipo_weights_reference(logp, old, adv, mask, tau=32.0, clip=(1.0, 1.2), c=10.0, safety=None,
                               packed=False)
    ref, _ = ppo_reference(logp, old, adv * w, mask, el=0.2, eh=0.28, c=10.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    inside = w[mask][(w[mask] > 1.0) & (w[mask] < 1.2)]
    assert inside.numel() > 10, "exp(F) should lie strictly inside [1, 1.2] on many tokens (tau matters)"

    logp_s, old_s, adv_s, mask_s = _gspo_batch()
    loss, _ = default("gspo")(logp_s, old_s, adv_s, mask_s)
    torch.testing.assert_close(loss, gspo_reference(logp_s, old_s, adv_s, mask_s, el=3e-4, eh=4e-4),
                               rtol=1e-12, atol=1e-12)


def _gspo_batch():
    """One response per row, sequence log-ratios chosen on both sides of the default clip range
    [1 - 3e-4, 1 + 4e-4], inside it, far below (exp(-30): the -20 clamp) and far above (+30), and a
    one-token response inside the range (its mean is its own log-ratio)."""
    seq = [0.01, -0.01, 1e-4, -1e-4, 0.01, -0.01, -30.0, 30.0, 2e-4]
    adv_row = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.5]
    b, t = len(seq), 6
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    mask = torch.zeros(b, t, dtype=torch.bool)
    logp = old.clone()
    for i, (s, n) in enumerate(zip(seq, [6, 5, 4, 6, 3, 6, 2, 6, 1])):  # the last row: one token
        mask[i, :n] = True
        noise = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
        logp[i, :n] = old[i, :n] + s + noise - noise.mean()  # the row's mean log-ratio is s
    adv = torch.tensor(adv_row, dtype=torch.float64)[:, None] * mask
    return logp, old, adv, mask


def test_gspo_sequence_ratio_is_clamped_on_both_sides():
    """A sequence whose mean log-ratio is -30 (or +30) has ratio exp(-20) (exp(20)), as token ratios do:
    the clamp bounds the loss of a far off-policy response, and the gradient follows it."""
    logp, old, adv, mask = _gspo_batch()
    lp = logp.clone().requires_grad_(True)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ref = gspo_reference(logp, old, adv, mask, el=0.2, eh=0.28)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    assert float(loss[6, 0].detach()) == pytest.approx(-math.exp(-20.0), rel=1e-12)
    assert float(loss[7, 0].detach()) == pytest.approx(math.exp(20.0), rel=1e-12)
    loss.sum().backward()  # d/dlogp_t of -A s_it = -A s_i on an unclipped row
    torch.testing.assert_close(lp.grad[6, :2], torch.full((2,), -math.exp(-20.0), dtype=torch.float64),
                               rtol=1e-12, atol=0)
    # Truncated-IS weights multiply GSPO's per-token loss too.
    isw = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    weighted, _ = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weights=isw)
    torch.testing.assert_close(weighted, ref * isw * mask, rtol=1e-12, atol=0)


def test_truncated_is_weights_cap_boundary_and_extremes():
    """``min(pi_old / pi_engine, C)`` on the mask, 0 off it (the trainer's only TIS function,
    ``losses/importance.py``): a token the engine over-rates by e^30 keeps its tiny weight e^-30 (no
    floor), one it under-rates by e^30 gets C; a ratio exactly at the cap is not counted as capped."""
    from megatron_credit.losses.importance import truncated_is_weights

    old = torch.zeros(1, 6, dtype=torch.float64)
    roll = torch.tensor([[-math.log(2.5), -math.log(1.5), 30.0, -30.0, 0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    w, m = truncated_is_weights(old, roll, mask, cap=2.0)
    want = torch.tensor([[2.0, 1.5, math.exp(-30.0), 2.0, math.exp(-0.5), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)
    assert float(m["tis_capped_frac"]) == pytest.approx(2 / 5)
    torch.testing.assert_close(m["tis_mean_weight"], want[mask].mean(), rtol=1e-12, atol=0)
    at_cap, m = truncated_is_weights(old[:, :2], torch.tensor([[-math.log(2.0), 0.0]], dtype=torch.float64),
                                     mask[:, :2], cap=2.0)
    assert float(m["tis_capped_frac"]) == 0.0 and at_cap[0, 0] == pytest.approx(2.0, rel=1e-15)
    half, _ = truncated_is_weights(old, roll, mask, cap=0.5)
    torch.testing.assert_close(half[mask], torch.minimum(want[mask], torch.tensor(0.5, dtype=torch.float64)))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=rf"cap must be > 0, got {bad}"):
            truncated_is_weights(old, roll, mask, cap=bad)


@pytest.mark.parametrize("name,public", [("dapo", ppo_clip_loss), ("fipo", fipo_policy_loss),
                                         ("gspo", gspo_loss)])
def test_registry_default_params_are_the_public_defaults(name, public):
    """``ALGORITHMS.get(name)()`` (what a recipe without params gets) names the documented values, and its
    algorithm computes the same loss as the public function given them."""
    documented = {"dapo": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": 3.0},
                  "fipo": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": 10.0, "tau": 32.0,
                           "weight_clip": (1.0, 1.2), "safety_thresh": None},
                  "gspo": {"clip_low": 3e-4, "clip_high": 4e-4}}[name]
    config = ALGORITHMS.get(name)()
    assert {k: getattr(config, k) for k in documented} == documented
    logp, old, adv, mask = _gspo_batch() if name == "gspo" else _defaults_batch()
    via_registry, _ = config.build().loss(logp, old, adv, mask)
    assert torch.equal(via_registry, public(logp, old, adv, mask, **documented)[0])


# --- PPO clip: edges of the ratio, the advantage sign and the clip range ----------------------------
def test_ppo_clip_ratio_clamp_zero_advantages_and_boundaries():
    """Log-ratios beyond +-20 are clamped (the published code: no inf, bounded loss and KL metric) on
    both sides; zero advantages are neither clipped-low nor dual-clipped; a ratio exactly at c is not
    dual-clipped (the cap leaves its loss unchanged)."""
    c = 4.0  # exp(log 4) == 4 exactly in float64, so the token below sits *at* c
    d = torch.tensor([[30.0, -30.0, 30.0, -30.0, math.log(c), -0.5, -0.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, -2.0, 0.0, -1.0, 0.0]], dtype=torch.float64)
    old = torch.zeros_like(d)
    mask = torch.ones_like(d, dtype=torch.bool)
    for dual in (None, c):
        lp = d.clone().requires_grad_(True)
        loss, m = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=dual)
        loss.sum().backward()
        ref, grad = ppo_reference(d, old, adv, mask, el=0.2, eh=0.28, c=dual)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        # Beyond the clamp the ratio is a constant: no gradient there (as torch.clamp, and the published code).
        # At ratio == c the two branches of the dual clip tie (any subgradient is right): not compared.
        cmp = [0, 1, 2, 3, 5, 6, 7] if dual else list(range(8))
        torch.testing.assert_close(lp.grad[:, cmp], torch.where(d.abs() > 20, 0.0, grad)[:, cmp], rtol=1e-12,
                                   atol=0)
        lr = d.clamp(-20, 20)
        torch.testing.assert_close(m["approx_kl"], (torch.expm1(lr) - lr).mean(), rtol=1e-12, atol=0)
        # clipped low: A < 0 and r < 0.8 -> tokens 3 and 6 (not the A = 0 token 5)
        assert float(m["clipfrac_low"]) == 2 / 8
        # clipped high: A > 0 and r > 1.28 -> token 2 (not the A = 0 token 7 at r = e^0.5)
        assert float(m["clipfrac_high"]) == 1 / 8
        # dual: A < 0 and r > c -> token 0 only (token 4 sits exactly at c)
        assert float(m["clipfrac_dual"]) == (1 / 8 if dual else 0.0)
    assert float(loss[0, 0].detach()) == pytest.approx(c, rel=1e-15)  # -A c = 4, not -A e^20
    assert float(loss[0, 1].detach()) == pytest.approx(-math.exp(-20.0), rel=1e-12)


def test_ratio_exactly_at_a_clip_bound_is_not_clipped():
    """r == 1 - eps_low (A < 0) or r == 1 + eps_high (A > 0): the clip leaves the loss unchanged, so the
    token is not counted as clipped (0.5 and 1.5 are exact in float64 through log and exp)."""
    d = torch.tensor([[math.log(0.5), math.log(1.5)]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    loss, m = ppo_clip_loss(d, torch.zeros_like(d), adv, torch.ones_like(d, dtype=torch.bool), clip_low=0.5,
                            clip_high=0.5)
    assert loss.tolist() == [[0.5, -1.5]]
    assert float(m["clipfrac_low"]) == 0.0 and float(m["clipfrac_high"]) == 0.0


@pytest.mark.parametrize("clip_low,clip_high", [(0.0, 0.28), (0.2, 0.0), (0.0, 0.0)])
def test_ppo_clip_range_edges_are_valid(clip_low, clip_high):
    """A one-sided clip (eps = 0 on either side) is a valid setting and follows the formula."""
    logp, old, adv, mask = _defaults_batch()
    loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high)
    ref, _ = ppo_reference(logp, old, adv, mask, el=clip_low, eh=clip_high, c=3.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clip_low,clip_high", [(1.0, 0.28), (1.5, 0.28), (-0.1, 0.28), (0.2, -0.1)])
def test_ppo_clip_range_outside_is_refused(clip_low, clip_high):
    logp, old, adv, mask = _defaults_batch()
    with pytest.raises(ValueError, match=rf"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, "
                                         rf"{clip_high}"):
        ppo_clip_loss(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high)


def test_multi_dual_clip_keep_counts_only_negative_advantages():
    """Tokens above c with A = 0 or 0 < A < 1 are not dual-clipped (the dual clip acts on A < 0): a
    response of such tokens is kept; the same response with A < 0 is dropped."""
    logp = torch.full((3, 4), 3.0, dtype=torch.float64)  # ratio e^3 > c = 10 on every token
    old = torch.zeros_like(logp)
    adv = torch.tensor([[0.0] * 4, [0.5] * 4, [-0.5] * 4], dtype=torch.float64)
    keep = multi_dual_clip_keep(logp, old, adv, torch.ones(3, 4, dtype=torch.bool), dual_clip_c=10.0)
    assert keep.tolist() == [True, True, False]


# --- aggregation and metrics with a single token ---------------------------------------------------
@pytest.mark.parametrize("mode", AGG_MODES)
def test_one_valid_token_is_its_own_mean(mode):
    """A batch (or a whole step) with exactly one valid token in one response: every mean is that
    token's loss (a denominator of 1 must stay 1); Dr.GRPO's divides by L on top."""
    per_token = torch.tensor([[0.0, 2.5, 0.0], [7.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False], [False, False, False]])
    per_token, mask = per_token[:1], mask[:1]
    kw = {"norm_length": 1} if mode == "seq-mean-token-sum-norm" else {}
    assert float(aggregate_loss(per_token, mask, mode=mode, **kw)) == 2.5
    glob = {"global_num_tokens": 1, "global_num_seqs": 1, "seq_num_tokens": torch.tensor([1])}
    assert float(aggregate_loss(per_token, mask, mode=mode, **glob, norm_length=1)) == 2.5
    # ... and the loss's metrics are that token's, not halved.
    lp = torch.tensor([[0.0, -0.5, 0.0]], dtype=torch.float64)
    _, m = ppo_clip_loss(lp, torch.zeros_like(lp), -torch.ones_like(lp), mask)
    assert float(m["approx_kl"]) == pytest.approx(math.expm1(-0.5) + 0.5, rel=1e-12)
    assert float(m["clipfrac_low"]) == 1.0


def test_norm_length_must_be_positive_and_named():
    per_token = torch.ones(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert float(aggregate_loss(per_token, mask, mode="seq-mean-token-sum-norm", norm_length=1)) == 3.0
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"norm_length must be > 0, got {bad}"):
            aggregate_loss(per_token, mask, mode="seq-mean-token-sum-norm", norm_length=bad)


# --- group estimators: groups of one, two and more ----------------------------------------------
def test_group_advantages_for_groups_of_one_two_and_more():
    """GRPO's unbiased std and RLOO's leave-one-out mean at n = 2 (where n - 1 = 1 is the whole
    denominator), n = 1 (advantage 0) and larger groups, ids interleaved, against loop references."""
    ids = torch.tensor([5, 9, 2, 5, 9, 9, 2, 7, 2, 9])  # sizes: 5 -> 2, 9 -> 4, 2 -> 3, 7 -> 1
    scores = torch.tensor([0.3, 1.0, -2.0, 1.7, 0.0, 0.5, 4.0, 3.3, 1.0, -1.5], dtype=torch.float64)
    want_grpo = group_advantages_reference(scores, ids, "grpo")  # eps 1e-6 in the std, 0 for a group of one
    want_centred = group_advantages_reference(scores, ids, "dr_grpo")
    want_rloo = group_advantages_reference(scores, ids, "rloo")
    torch.testing.assert_close(grpo_advantages(scores, ids), want_grpo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grpo_advantages(scores, ids, norm_by_std=False), want_centred,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dr_grpo_advantages(scores, ids), want_centred, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rloo_advantages(scores, ids), want_rloo, rtol=1e-12, atol=1e-12)
    # The pair (0.3, 1.7): unbiased std = |a - b| / sqrt(2), so GRPO gives -+1/sqrt(2) (up to eps).
    assert float(grpo_advantages(scores, ids)[0]) == pytest.approx(-1 / math.sqrt(2), rel=1e-5)


def test_group_estimators_name_bad_shapes_and_keep_the_advantage_dtype():
    with pytest.raises(ValueError, match=r"scores and group_ids must both be \[N\], got \(2, 2\) and \(4,\)"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(4, dtype=torch.long))
    # A float mask must not promote bf16 / fp32 advantages to its own dtype.
    adv = torch.tensor([1.5, -0.5], dtype=torch.bfloat16)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    out = broadcast_to_tokens(adv, mask)
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [[1.5, 1.5, 0.0], [-0.5, 0.0, 0.0]]


# --- CompPO gate ----------------------------------------------------------------------------------
def test_comppo_gate_default_tau_and_envelope_edges():
    """docs/architecture.md: kappa = k_lo + (k_hi - k_lo) sigmoid(tau (c - 1/2)) with (0.1, 0.9), tau = 4. The
    envelope may reach [0, 1], and k_lo == k_hi is a constant gate (the fixed-gate control, 0.61)."""
    g = torch.Generator().manual_seed(5)
    n = torch.randint(1, 40, (64,), generator=g)
    h = 1 / n.double() + torch.rand(64, generator=g, dtype=torch.float64) * (1 - 1 / n.double())
    torch.testing.assert_close(comppo_gate(h, n), comppo_gate_reference(h, n, k_lo=0.1, k_hi=0.9, tau=4.0),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(comppo_gate(h, n, k_lo=0.0, k_hi=1.0),
                               comppo_gate_reference(h, n, k_lo=0.0, k_hi=1.0, tau=4.0), rtol=1e-12, atol=1e-12)
    assert torch.equal(comppo_gate(h, n, k_lo=0.61, k_hi=0.61), torch.full_like(h, 0.61))
    for k_lo, k_hi in ((-0.1, 0.5), (0.6, 0.5), (0.1, 1.5)):
        with pytest.raises(ValueError, match=rf"need 0 <= k_lo <= k_hi <= 1, got k_lo={k_lo}, k_hi={k_hi}"):
            comppo_gate(h, n, k_lo=k_lo, k_hi=k_hi)


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
