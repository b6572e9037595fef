"""Bad input at the recipe surface: typos inside ``model.architecture`` and non-finite numbers are
refused with the field named; the keys real recipes and HF configs use are still accepted."""
from __future__ import annotations

import pytest

from megatron_credit.recipe.config import TINY_QWEN2, ModelConfig, recipe_from_dict

ARCH_TYPOS = {
    "qwen2 hidden_sizee": ({**TINY_QWEN2, "hidden_sizee": 32},
                           r"unknown key for model_type 'qwen2': 'hidden_sizee' \(did you mean 'hidden_size'\?\)"),
    "llama two typos": ({"model_type": "llama", "num_hiden_layers": 2, "rms_eps": 1e-5},
                        r"unknown keys for model_type 'llama': 'num_hiden_layers' \(did you mean "
                        r"'num_hidden_layers'\?\), 'rms_eps' \(did you mean 'rms_norm_eps'\?\)"),
    "qwen3 no close match": ({"model_type": "qwen3", "zzz": 1}, r"unknown key for model_type 'qwen3': 'zzz'$"),
    "unsupported family": ({"model_type": "gpt2", "n_embd": 8},
                           r"model.architecture.model_type 'gpt2' is not supported; valid: \['qwen2', 'qwen3', 'llama', 'mistral', 'qwen3_moe'\]"),
}


@pytest.mark.parametrize("case", sorted(ARCH_TYPOS))
def test_architecture_typos_are_refused_with_the_closest_name(case):
    arch, message = ARCH_TYPOS[case]
    with pytest.raises(ValueError, match=message):
        ModelConfig(architecture=arch)
    with pytest.raises(ValueError, match=message):  # and through a recipe override
        recipe_from_dict({"model": {"architecture": dict(arch)}})


VALID_ARCHS = {
    "tiny qwen2 (4.x rope_theta)": dict(TINY_QWEN2),
    "qwen3 head_dim, attention_bias": {"model_type": "qwen3", "hidden_size": 64, "head_dim": 32,
                                       "attention_bias": False, "rope_parameters": {"rope_theta": 1e6,
                                                                                   "rope_type": "default"}},
    "llama 3.1 rope_scaling, mlp_bias, torch_dtype": {
        "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "mlp_bias": False,
        "torch_dtype": "bfloat16", "tie_word_embeddings": True, "bos_token_id": 1, "pretraining_tp": 1},
}


@pytest.mark.parametrize("case", sorted(VALID_ARCHS))
def test_real_architecture_keys_are_accepted(case):
    assert ModelConfig(architecture=VALID_ARCHS[case]).architecture == VALID_ARCHS[case]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "nan", "-Infinity"])
def test_non_finite_floats_are_refused(value):
    with pytest.raises(ValueError, match=r"optim.lr must be a finite number, got"):
        recipe_from_dict({"optim": {"lr": value}})


def test_yaml_infinity_override_is_refused():
    with pytest.raises(ValueError, match=r"optim.lr must be a finite number, got inf \(float\)"):
        recipe_from_dict({}, overrides=["optim.lr=.inf"])
    assert recipe_from_dict({}, overrides=["optim.lr=1e-3"]).optim.lr == 1e-3


@pytest.mark.parametrize("overrides,message", [
    (["optim.backend=deepspeed"], r"optim.backend must be local or megatron, got 'deepspeed'"),
    (["optim.distributed_optimizer=true"], r"optim.distributed_optimizer: true needs optim.backend: megatron"),
    (["cluster.distributed_optimizer=true"],
     r"cluster.distributed_optimizer: true plans sharded optimizer states that this run would not shard"),
])
def test_optimizer_backend_choices_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict({}, overrides=overrides)
    ok = recipe_from_dict({}, overrides=["optim.backend=megatron", "optim.distributed_optimizer=true",
                                         "cluster.distributed_optimizer=true"])
    assert ok.optim.backend == "megatron" and ok.optim.distributed_optimizer


@pytest.mark.parametrize("make", ["missing", "empty folder", "garbage tokenizer.json"])
def test_a_bad_tokenizer_path_names_the_field_and_the_path(tmp_path, make):
    """data.tokenizer_path that holds no tokenizer: one ValueError naming the field and the folder
    (it was a transformers traceback)."""
    from megatron_credit.trainer.loop import hf_tokenizer

    path = tmp_path / "tok"
    if make != "missing":
        path.mkdir()
    if make == "garbage tokenizer.json":
        (path / "tokenizer.json").write_text("{not json")
        (path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        hf_tokenizer(str(path), field="data.tokenizer_path")
    message = str(info.value)
    assert message.startswith("data.tokenizer_path: no tokenizer could be loaded from ") and str(path) in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["rloo", "dr_grpo"])
def test_norm_by_std_is_refused_where_it_means_nothing(name):
    # RLOO and Dr.GRPO never divide by the group's std; norm_by_std was accepted and ignored.
    with pytest.raises(ValueError, match=r"^unknown field\(s\) \['norm_by_std'\] in algorithm.params; "
                                         r"valid: \['clip_eps'\]$"):
        recipe_from_dict({"algorithm": {"name": name, "params": {"norm_by_std": False}}})
    grpo = recipe_from_dict({"algorithm": {"name": "grpo", "params": {"norm_by_std": False}}})
    assert grpo.algorithm.build().config.norm_by_std is False


def test_an_in_process_vllm_engine_under_a_split_trainer_is_refused_in_one_line():
    from megatron_credit.recipe.config import recipe_from_dict

    recipe = recipe_from_dict({}, overrides=[
        "rollout.engine=vllm", "parallel.tensor_model_parallel_size=2",
        "rollout.engine_options.engine_kwargs.distributed_executor_backend=external_launcher"])
    problems = recipe.problems(recipe.model.hf_config(), world_size=2)
    assert [p for p in problems if "external_launcher" in p] == [
        "rollout.engine_options.engine_kwargs.distributed_executor_backend=external_launcher needs "
        "parallel.tensor_model_parallel_size = pipeline_model_parallel_size = context_parallel_size = 1 "
        "(got 2, 1, 1): vLLM would build its groups over the trainer's whole world; use the default "
        "multiprocess engine"]
    three = recipe_from_dict({}, overrides=["rollout.engine_options.tensor_parallel_size=3"])
    assert "rollout.engine_options.tensor_parallel_size=3 must divide the world size 4" in " ".join(
        three.problems(three.model.hf_config(), world_size=4))


@pytest.mark.parametrize("override,message", [
    ("logging.credit_map_every=-1", r"^logging.credit_map_every must be >= 0, got -1$"),
    ("logging.credit_map_samples=0", r"^logging.credit_map_samples must be >= 1, got 0$"),
])
def test_credit_map_fields_are_checked(override, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict({}, overrides=[override])
    ok = recipe_from_dict({}, overrides=["logging.credit_map_every=0", "logging.credit_map_samples=1"])
    assert (ok.logging.credit_map_every, ok.logging.credit_map_samples) == (0, 1)
    assert recipe_from_dict({}).logging.credit_map_every is None  # with validation
