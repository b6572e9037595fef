"""The expert-parallel fields and the ``moe`` section: each bad value refused in one line naming the field."""
from __future__ import annotations

import pytest

from megatron_credit.recipe.config import recipe_from_dict
from tests.trainer.test_moe_expert_parallel import TINY_MOE


def _problems(overrides, *, world: int, arch=TINY_MOE):
    recipe = recipe_from_dict({"model": {"architecture": dict(arch)}}, overrides=overrides)
    return recipe.problems(recipe.model.hf_config(), world_size=world)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.expert_model_parallel_size=3"], 3, "parallel.expert_model_parallel_size=3 does not divide num_experts=4"),
    (["parallel.expert_model_parallel_size=2"], 1, "parallel.expert_model_parallel_size=2 x expert_tensor_parallel_size=1 "
     "must divide the 1 ranks of a pipeline stage"),
    (["parallel.expert_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], 2,
     "must divide the 1 ranks of a pipeline stage"),
    (["parallel.expert_tensor_parallel_size=2"], 2, "parallel.expert_tensor_parallel_size=2 must equal "
     "tensor_model_parallel_size=1"),
])
def test_expert_layouts_are_refused_in_one_line(overrides, world, message):
    problems = _problems(overrides, world=world)
    assert problems and message in problems[0] and "\n" not in problems[0]


def test_a_dense_model_refuses_expert_parallelism():
    from megatron_credit.recipe.config import TINY_QWEN2

    problems = _problems(["parallel.expert_model_parallel_size=2"], world=2, arch=TINY_QWEN2)
    assert problems[0] == ("parallel.expert_model_parallel_size=2 needs a mixture-of-experts model: qwen2 has no "
                           "routed experts")


def test_the_router_losses_reach_the_transformer_config():
    from megatron_credit.models import actor_transformer_config

    recipe = recipe_from_dict({"model": {"architecture": dict(TINY_MOE)}},
                              overrides=["moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=0.001"])
    cfg = actor_transformer_config(recipe.model.hf_config(), parallel=recipe.parallel, params_dtype=recipe.model.torch_dtype(),
                                   moe=recipe.moe)
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == ("aux_loss", 0.01, 0.001)
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.num_moe_experts == 4 and cfg.moe_router_topk == 2
    with pytest.raises(ValueError, match=r"moe.load_balancing_type='sinkhorn' is not one of"):
        recipe_from_dict({}, overrides=["moe.load_balancing_type=sinkhorn"])


def test_routing_replay_takes_rollout_or_none():
    assert recipe_from_dict({}).moe.routing_replay == "rollout"
    assert recipe_from_dict({}, overrides=["moe.routing_replay=none"]).moe.routing_replay == "none"
    with pytest.raises(ValueError, match=r"^moe.routing_replay='r2' is not one of \['rollout', 'none'\]$"):
        recipe_from_dict({}, overrides=["moe.routing_replay=r2"])


def test_grouped_gemm_follows_the_spec_and_the_recipe_can_turn_it_off():
    """TE's spec: the experts as TE's grouped GEMM (``TEGroupedMLP``) unless ``moe.grouped_gemm=false``; the local
    spec (CPU): ``SequentialMLP`` whatever the recipe says, and a grouped config is refused by the local spec."""
    from megatron_credit.models import actor_transformer_config
    from megatron_credit.models.gpt import gpt_layer_spec
    from megatron_credit.recipe.config import TINY_QWEN2

    def grouped(overrides=(), *, te: bool, arch=TINY_MOE) -> bool:
        recipe = recipe_from_dict({"model": {"architecture": dict(arch)}}, overrides=list(overrides))
        return actor_transformer_config(recipe.model.hf_config(), parallel=recipe.parallel, params_dtype=recipe.model.torch_dtype(),
                                        transformer_engine=te, moe=recipe.moe).moe_grouped_gemm

    assert recipe_from_dict({}).moe.grouped_gemm is True
    assert grouped(te=True) is True and grouped(["moe.grouped_gemm=false"], te=True) is False
    assert grouped(te=False) is False and grouped(["moe.grouped_gemm=true"], te=False) is False
    assert grouped(te=True, arch=TINY_QWEN2) is False  # no experts
    recipe = recipe_from_dict({"model": {"architecture": dict(TINY_MOE)}})
    cfg = actor_transformer_config(recipe.model.hf_config(), parallel=recipe.parallel, params_dtype=recipe.model.torch_dtype(),
                                   transformer_engine=True, moe=recipe.moe)
    with pytest.raises(ValueError, match=r"^moe_grouped_gemm=True needs the Transformer Engine spec \(TEGroupedMLP\); "
                                         r"the local spec builds SequentialMLP: build the TransformerConfig with "
                                         r"transformer_engine=False$"):
        gpt_layer_spec(cfg, use_transformer_engine=False)
