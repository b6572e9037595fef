"""The algorithm registries: names, duplicates, errors, and that each entry computes what it names."""
import pytest
import torch

from megatron_credit.algorithm.spec import (ADVANTAGE_ESTIMATORS, ALGORITHMS, POLICY_LOSSES, AdvantageInputs,
                                        AlgorithmSpec)
from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.group import grpo_advantages, rloo_advantages
from megatron_credit.losses.policy import ppo_clip_loss


def test_every_algorithm_is_registered_and_consistent():
    assert ALGORITHMS.names() == ["comppo", "comppo_fipo", "dapo", "dr_grpo", "fipo", "grpo", "gspo", "ppo", "rloo"]
    assert ADVANTAGE_ESTIMATORS.names() == ["comp_gae", "dr_grpo", "gae", "grpo", "rloo"]
    assert POLICY_LOSSES.names() == ["dapo", "fipo", "gspo", "ppo"]
    for name in ALGORITHMS:
        spec = ALGORITHMS.get(name)
        assert spec.advantage_estimator in ADVANTAGE_ESTIMATORS and spec.policy_loss in POLICY_LOSSES
        assert spec.needs_critic == (spec.advantage_estimator in ("gae", "comp_gae"))
    assert ALGORITHMS.get("comppo").needs_gates and not ALGORITHMS.get("ppo").needs_gates


def test_duplicates_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.add("dapo", ppo_clip_loss)
    with pytest.raises(ValueError, match=r"unknown algorithm 'grpo2'; valid names: \['comppo', 'comppo_fipo'"):
        ALGORITHMS.get("grpo2")
    with pytest.raises(ValueError, match="valid names"):
        AlgorithmSpec(advantage_estimator="gae", policy_loss="trpo", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        AlgorithmSpec(advantage_estimator="gae", policy_loss="ppo", loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"unknown policy loss 'trpo'; valid names: \['dapo'"):
        POLICY_LOSSES.remove("trpo")
    POLICY_LOSSES.add("tmp_loss", ppo_clip_loss)
    assert POLICY_LOSSES.remove("tmp_loss") is ppo_clip_loss and "tmp_loss" not in POLICY_LOSSES.names()


def _inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 3:] = False
    return AdvantageInputs(
        response_mask=mask, scores=torch.randn(6, generator=g, dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 2]),
        token_rewards=torch.randn(6, 5, generator=g, dtype=torch.float64) * mask,
        values=torch.randn(6, 5, generator=g, dtype=torch.float64),
        gates=torch.rand(6, 5, generator=g, dtype=torch.float64))


def test_estimators_compute_what_they_name():
    x = _inputs()
    out = ADVANTAGE_ESTIMATORS.get("grpo")(x)
    torch.testing.assert_close(out.advantages, grpo_advantages(x.scores, x.group_ids)[:, None] * x.response_mask)
    out = ADVANTAGE_ESTIMATORS.get("rloo")(x)
    torch.testing.assert_close(out.advantages, rloo_advantages(x.scores, x.group_ids)[:, None] * x.response_mask)
    out = ADVANTAGE_ESTIMATORS.get("gae")(x, gamma=0.9, lam=0.8)
    ref = gae(x.token_rewards, x.values, x.response_mask, gamma=0.9, lam=0.8)
    assert torch.equal(out.advantages, ref[0]) and torch.equal(out.returns, ref[1])
    out = ADVANTAGE_ESTIMATORS.get("comp_gae")(x, lam=0.8)
    assert torch.equal(out.advantages, comp_gae(x.token_rewards, x.values, x.gates, x.response_mask, lam=0.8)[0])
    with pytest.raises(ValueError, match="gates"):
        ADVANTAGE_ESTIMATORS.get("comp_gae")(AdvantageInputs(response_mask=x.response_mask,
                                                             token_rewards=x.token_rewards, values=x.values))


def test_policy_losses_compute_what_they_name():
    x = _inputs()
    logp = -torch.rand(6, 5, dtype=torch.float64)
    old = logp + 0.5 * torch.randn(6, 5, dtype=torch.float64)
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(x).advantages
    ppo, _ = POLICY_LOSSES.get("ppo")(logp, old, adv, x.response_mask, clip_eps=0.2)
    assert torch.equal(ppo, ppo_clip_loss(logp, old, adv, x.response_mask, clip_low=0.2, clip_high=0.2,
                                          dual_clip_c=None)[0])
    dapo, _ = POLICY_LOSSES.get("dapo")(logp, old, adv, x.response_mask)
    fipo, _ = POLICY_LOSSES.get("fipo")(logp, old, adv, x.response_mask, weight_clip=(1.0, 1.0),
                                        dual_clip_c=3.0)
    assert torch.equal(fipo, dapo)  # GRPO/DAPO is FIPO with all weights 1
    gspo, _ = POLICY_LOSSES.get("gspo")(logp, old, adv, x.response_mask)
    assert gspo.shape == (6, 5) and torch.isfinite(gspo).all()


def test_specs_require_their_aggregation_arguments():
    # Dr.GRPO divides by a fixed length L: its spec refuses to aggregate without norm_length.
    spec = ALGORITHMS.get("dr_grpo")
    assert spec.agg_required_args == ("global_num_seqs", "norm_length")
    l = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="norm_length"):
        spec.aggregate(l, mask, global_num_seqs=3)
    assert torch.equal(spec.aggregate(l, mask, global_num_seqs=3, norm_length=8), l.sum() / 24)
    with pytest.raises(ValueError, match="seq_num_tokens"):
        ALGORITHMS.get("grpo").aggregate(l, mask, global_num_seqs=3)
    with pytest.raises(ValueError, match="global_num_tokens"):
        ALGORITHMS.get("dapo").aggregate(l, mask)
    for name in ALGORITHMS:
        assert ALGORITHMS.get(name).agg_required_args  # every mode names its denominators


def test_a_loss_gets_the_side_channels_it_names_and_no_other():
    ppo = ALGORITHMS.get("grpo")
    params = ppo.make_params({})
    assert not ppo.loss_takes("kappa") and not ppo.loss_takes("token_weight") and ppo.loss_takes("is_weights")
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(2, 5, generator=g), -torch.rand(2, 5, generator=g)
    adv, mask = torch.randn(2, 5, generator=g), torch.ones(2, 5, dtype=torch.bool)
    plain, _ = ppo.loss(logp, old, adv, mask, params)
    with_side, _ = ppo.loss(logp, old, adv, mask, params, side={"kappa": torch.ones(2, 5)})  # not its keyword
    assert torch.equal(plain, with_side)
