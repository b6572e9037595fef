"""``train.fuse_old_logprob``: the first mini-batch's old log-probs come from its own update forward
(detached) instead of a separate behaviour pass. On-policy that is the same policy, so a run gives the
same metrics and the same weights as the recomputing run; the settings it cannot serve are refused."""
from __future__ import annotations

import math

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.runs import TINY, VOLATILE


pytestmark = pytest.mark.dist


def _run(run_dir: str, overrides):
    from megatron_credit import distributed
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import train

    recipe = recipe_from_dict(TINY, overrides=[f"warmup.cache_dir={run_dir}-warmup-cache", "train.val_every=0",
                                               "algorithm.kl_coef=0.01", *overrides])
    device = distributed.initialize(recipe.parallel, seed=recipe.seed)
    try:
        rows = train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume="none",
                     log=lambda *a: None)
        from megatron_credit.trainer import loop  # noqa: F401  (the actor is gone: compare metrics)
        return rows
    finally:
        distributed.destroy()


pool = module_pool(1)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_fused_old_logprobs_give_the_recomputing_runs_numbers(pool, tmp_path, minibatches):
    common = [f"train.num_minibatches={minibatches}", "train.steps=3"]
    want = pool.run(_run, str(tmp_path / "recompute"), common)[0]
    got = pool.run(_run, str(tmp_path / "fused"), [*common, "train.fuse_old_logprob=true"])[0]
    assert len(got) == len(want) == 3
    keys = [k for k in want[0] if not k.startswith(VOLATILE)]
    assert "mismatch/logprob_abs_mean" in keys and "actor/kl_ref" in keys and "actor/grad_norm" in keys
    for g, w in zip(got, want):
        # the same metrics as the same iteration of the recomputing run (credit/* are absent from an
        # iteration without credited responses)
        assert sorted(k for k in g if not k.startswith(VOLATILE)) == sorted(k for k in w if not k.startswith(VOLATILE))
        for k in (k for k in keys if k in w):
            a, b = g[k], w[k]
            if isinstance(b, float) and math.isnan(b):
                assert math.isnan(a), k
            else:  # the same forward in train mode vs no_grad: equal to float32 rounding
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (k, a, b)
    assert any(w["actor/grad_norm"] > 0 for w in want)


@pytest.mark.parametrize("override,needle", [
    ("train.epochs=2", "2 epochs"),
    ("algorithm.name=ppo", "critic head on the trunk"),
])
def test_fused_old_logprobs_refuse_what_they_cannot_serve(pool, tmp_path, override, needle):
    with pytest.raises(Exception) as exc:
        pool.run(_run, str(tmp_path / "r"), ["train.steps=1", "train.fuse_old_logprob=true", override])
    assert "train.fuse_old_logprob" in str(exc.value) and needle in str(exc.value)
