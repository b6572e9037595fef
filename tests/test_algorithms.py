"""The algorithm catalog and the typed objects: names, duplicates, errors, defaults written once, and that
each algorithm computes what it names."""
import dataclasses

import pytest
import torch

from megatron_credit.algorithm.base import ActorCritic, AdvantageInputs, Algorithm
from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.algorithm.comppo import CompFIPO, CompPO
from megatron_credit.algorithm.fipo import FIPO
from megatron_credit.algorithm.grpo import DAPO, GRPO, GSPO, RLOO, DrGRPO
from megatron_credit.algorithm.ppo import PPO
from megatron_credit.credit.gae import comp_gae, gae
from megatron_credit.credit.group import dr_grpo_advantages, grpo_advantages, rloo_advantages
from megatron_credit.losses.policy import fipo_policy_loss, gspo_loss, ppo_clip_loss

BUILT_IN = {"grpo": GRPO, "dapo": DAPO, "dr_grpo": DrGRPO, "rloo": RLOO, "gspo": GSPO, "ppo": PPO, "fipo": FIPO,
            "comppo": CompPO, "comppo_fipo": CompFIPO}


def test_every_algorithm_is_a_config_class_that_builds_its_own_algorithm():
    assert ALGORITHMS.names() == sorted(BUILT_IN)
    for name, cls in BUILT_IN.items():
        config_cls = ALGORITHMS.get(name)
        assert config_cls is cls.Config and dataclasses.is_dataclass(config_cls)
        alg = config_cls().build()
        assert type(alg) is cls and alg.config == config_cls() and alg.recipe_config is alg.config
        assert (alg.critic_kind is not None) == isinstance(alg, ActorCritic)
    assert [n for n in BUILT_IN if BUILT_IN[n].Config().build().critic_kind is not None] == ["ppo", "comppo",
                                                                                            "comppo_fipo"]


def test_duplicates_unknown_names_and_bad_fields_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        ALGORITHMS.add("dapo", GRPO.Config)
    with pytest.raises(ValueError, match=r"unknown algorithm 'grpo2'; valid names: \['comppo', 'comppo_fipo'"):
        ALGORITHMS.get("grpo2")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['norm_by_std'\] in algorithm.params"):
        DAPO.Config.from_mapping({"norm_by_std": False})
    with pytest.raises(ValueError, match="algorithm.params.tau must be a number"):
        FIPO.Config.from_mapping({"tau": "soon"})
    with pytest.raises(ValueError, match=r"algorithm.params.critic='tac': valid values \['trunk', 'separate'\]"):
        PPO.Config(critic="tac")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        class Bad(GRPO):  # noqa: F841
            loss_agg_mode = "mean"

            @dataclasses.dataclass(frozen=True, kw_only=True)
            class Config(GRPO.Config):
                pass


def test_every_default_is_written_once_on_its_config():
    """The losses take their clip settings without defaults; DAPO's 0.2 / 0.28 / 3.0 are DAPO.Config's,
    and FIPO's tau reaches the Future-KL discount from its config in one hop (self.config.tau)."""
    import inspect

    for fn, names in ((ppo_clip_loss, ("clip_low", "clip_high", "dual_clip_c")), (gspo_loss, ("clip_low", "clip_high")),
                      (fipo_policy_loss, ("clip_low", "clip_high", "dual_clip_c", "tau", "weight_clip"))):
        params = inspect.signature(fn).parameters
        assert all(params[n].default is inspect.Parameter.empty for n in names), fn.__name__
    assert (DAPO.Config().clip_low, DAPO.Config().clip_high, DAPO.Config().dual_clip_c) == (0.2, 0.28, 3.0)
    assert (FIPO.Config().clip_low, FIPO.Config().clip_high) == (0.2, 0.28)  # inherited, not restated
    assert "clip_low" not in FIPO.Config.__dict__["__annotations__"]


def _inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 3:] = False
    return AdvantageInputs(
        response_mask=mask, scores=torch.randn(6, generator=g, dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 2]),
        token_rewards=torch.randn(6, 5, generator=g, dtype=torch.float64) * mask,
        values=torch.randn(6, 5, generator=g, dtype=torch.float64),
        extras={"gates": torch.rand(6, 5, generator=g, dtype=torch.float64)})


def test_estimators_compute_what_they_name():
    x = _inputs()
    m = x.response_mask
    out = GRPO.Config().build().estimate(x)
    torch.testing.assert_close(out.advantages, grpo_advantages(x.scores, x.group_ids)[:, None] * m)
    out = GRPO.Config(norm_by_std=False).build().estimate(x)
    torch.testing.assert_close(out.advantages, grpo_advantages(x.scores, x.group_ids, norm_by_std=False)[:, None] * m)
    for cls in (DAPO, GSPO, FIPO):  # GRPO's estimator, divided by the std
        assert torch.equal(cls.Config().build().estimate(x).advantages, GRPO.Config().build().estimate(x).advantages)
    out = RLOO.Config().build().estimate(x)
    torch.testing.assert_close(out.advantages, rloo_advantages(x.scores, x.group_ids)[:, None] * m)
    out = DrGRPO.Config().build().estimate(x)
    torch.testing.assert_close(out.advantages, dr_grpo_advantages(x.scores, x.group_ids)[:, None] * m)
    out = PPO.Config(gamma=0.9, lam=0.8).build().estimate(x)
    ref = gae(x.token_rewards, x.values, m, gamma=0.9, lam=0.8)
    assert torch.equal(out.advantages, ref[0]) and torch.equal(out.returns, ref[1])
    for cls in (CompPO, CompFIPO):
        out = cls.Config(lam=0.8).build().estimate(x)
        assert torch.equal(out.advantages, comp_gae(x.token_rewards, x.values, x.extras["gates"], m, lam=0.8)[0])
    with pytest.raises(ValueError, match="gates"):
        CompPO.Config().build().estimate(AdvantageInputs(response_mask=m, token_rewards=x.token_rewards,
                                                         values=x.values))


def test_policy_losses_compute_what_they_name():
    x = _inputs()
    m = x.response_mask
    logp = -torch.rand(6, 5, dtype=torch.float64)
    old = logp + 0.5 * torch.randn(6, 5, dtype=torch.float64)
    adv = GRPO.Config().build().estimate(x).advantages
    for cls in (GRPO, DrGRPO, RLOO, PPO, CompPO):
        got, _ = cls.Config(clip_eps=0.15).build().loss(logp, old, adv, m)
        assert torch.equal(got, ppo_clip_loss(logp, old, adv, m, clip_low=0.15, clip_high=0.15, dual_clip_c=None)[0])
    dapo, _ = DAPO.Config(clip_high=0.3).build().loss(logp, old, adv, m)
    assert torch.equal(dapo, ppo_clip_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.3, dual_clip_c=3.0)[0])
    for cls in (FIPO, CompFIPO):  # GRPO/DAPO is FIPO with all weights 1
        fipo, _ = cls.Config(weight_clip=(1.0, 1.0), dual_clip_c=3.0).build().loss(logp, old, adv, m)
        assert torch.equal(fipo, DAPO.Config().build().loss(logp, old, adv, m)[0])
        fipo, _ = cls.Config(tau=4.0).build().loss(logp, old, adv, m)
        assert torch.equal(fipo, fipo_policy_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip_c=10.0,
                                                  tau=4.0, weight_clip=(1.0, 1.2))[0])
    gspo, _ = GSPO.Config().build().loss(logp, old, adv, m)
    assert torch.equal(gspo, gspo_loss(logp, old, adv, m, clip_low=3e-4, clip_high=4e-4)[0])


def test_algorithms_require_their_aggregation_arguments():
    # Dr.GRPO divides by a fixed length L: it refuses to aggregate without norm_length.
    alg = DrGRPO.Config().build()
    assert alg.agg_required_args == ("global_num_seqs", "norm_length")
    l = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="norm_length"):
        alg.aggregate(l, mask, global_num_seqs=3)
    assert torch.equal(alg.aggregate(l, mask, global_num_seqs=3, norm_length=8), l.sum() / 24)
    with pytest.raises(ValueError, match="seq_num_tokens"):
        GRPO.Config().build().aggregate(l, mask, global_num_seqs=3)
    with pytest.raises(ValueError, match="global_num_tokens"):
        DAPO.Config().build().aggregate(l, mask)
    for name in ALGORITHMS:
        assert ALGORITHMS.get(name)().build().agg_required_args  # every mode names its denominators


def test_a_config_builds_the_class_that_declares_it():
    """A Config builds the class that declares it, so a subclass must declare one (else registering its
    parent's Config would silently build the parent)."""
    with pytest.raises(TypeError, match=r"^Quiet must declare its own nested Config"):
        class Quiet(GRPO):  # noqa: F841
            pass

    class Loud(GRPO):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Config(GRPO.Config):
            volume: float = 2.0

    assert type(GRPO.Config().build()) is GRPO
    assert type(Loud.Config().build()) is Loud and Loud.Config().clip_eps == 0.2
    assert Algorithm.Config()._owner is Algorithm


def _train_batch():
    from megatron_credit.batch.train_batch import TrainBatch

    b, t = 2, 5
    mask = torch.ones(b, t, dtype=torch.bool)
    return TrainBatch(input_ids=torch.zeros(b, t, dtype=torch.long), labels=torch.zeros(b, t, dtype=torch.long),
                      loss_mask=mask, rollout_logp=torch.zeros(b, t), seq_lens=torch.full((b,), t),
                      group_ids=torch.arange(b), rewards=torch.zeros(b), correct=torch.zeros(b, dtype=torch.bool),
                      old_logp=torch.full((b, t), -0.5), extras={"kappa": torch.ones(b, t)})


def _side_channel_algorithm(made: tuple, named: tuple):
    class Weighted(GRPO):
        side_channels = named

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Config(GRPO.Config):
            pass

        def behaviour_extras(self, batch):
            return {k: batch.old_logp.exp() for k in made}

    return Weighted.Config().build()


def test_the_side_channels_after_the_behaviour_pass_are_checked_in_one_line():
    from megatron_credit.trainer.step import add_behaviour_extras

    batch = _train_batch()
    add_behaviour_extras(_side_channel_algorithm(("w",), ("w", "kappa")), batch)  # a capture's output may be named
    assert torch.equal(batch.extras["w"], torch.tensor(-0.5).exp().expand(2, 5))
    with pytest.raises(ValueError, match=r"^behaviour_extras names \['u'\], which Weighted.side_channels \['w'\] "
                                         r"does not name$"):
        add_behaviour_extras(_side_channel_algorithm(("u",), ("w",)), _train_batch())
    with pytest.raises(ValueError, match=r"^Weighted.side_channels names \['v'\], which neither its capture nor its "
                                         r"behaviour_extras makes$"):
        add_behaviour_extras(_side_channel_algorithm(("w",), ("w", "v")), _train_batch())
    with pytest.raises(ValueError, match=r"behaviour_extras names \['kappa'\] clash"):
        add_behaviour_extras(_side_channel_algorithm(("kappa",), ("kappa",)), _train_batch())
    plain = _train_batch()
    add_behaviour_extras(GRPO.Config().build(), plain)  # nothing made, nothing named
    assert list(plain.extras) == ["kappa"]


def test_fusing_the_old_log_probs_is_refused_for_side_channels_of_the_behaviour_pass():
    import types

    from megatron_credit.trainer.step import fused_old_logprob

    ctx = types.SimpleNamespace(train=types.SimpleNamespace(fuse_old_logprob=True), knobs=types.SimpleNamespace(epochs=1),
                                algorithm=_side_channel_algorithm(("w",), ("w",)),
                                actor=types.SimpleNamespace(capture=None, with_critic=False))
    with pytest.raises(ValueError, match=r"^train\.fuse_old_logprob: this algorithm's loss reads side channels made "
                                         r"after the behaviour pass \['w'\]; set train\.fuse_old_logprob=false$"):
        fused_old_logprob(ctx)
    ctx.algorithm = GRPO.Config().build()
    assert fused_old_logprob(ctx)
