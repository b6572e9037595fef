"""HF config -> megatron TransformerConfig / GPTModel: architecture fields, refusals, and logits equal
to ``transformers`` for the same weights (Qwen2 with QKV bias, Qwen3 with q/k norm and tied embeddings,
Llama 3.1 RoPE scaling), on one process (world size 1, gloo)."""
from __future__ import annotations

import pytest
import torch
import transformers

from megatron_credit.recipe.config import ModelConfig, ParallelConfig
from megatron_credit.models import (check_parallel_fits_model, rope_settings,
                                    transformer_config_from_hf)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6)


def _hf(model_type, **kw):
    return ModelConfig(architecture=dict(model_type=model_type, **{**TINY, **kw})).hf_config()


def test_qwen2_fields():
    hf = _hf("qwen2", rope_theta=1e6)
    tc = transformer_config_from_hf(hf, parallel=ParallelConfig())
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (2, 32, 48)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (4, 2, 8)
    assert tc.add_qkv_bias and not tc.add_bias_linear and not tc.qk_layernorm
    assert tc.gated_linear_unit and tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-6
    assert tc.use_cpu_initialization and not tc.gradient_accumulation_fusion
    assert rope_settings(hf).base == 1e6


def test_qwen3_and_llama_fields():
    q3 = transformer_config_from_hf(_hf("qwen3", head_dim=16), parallel=ParallelConfig())
    assert q3.qk_layernorm and not q3.add_qkv_bias and q3.kv_channels == 16
    ll = transformer_config_from_hf(_hf("llama"), parallel=ParallelConfig(),
                                    params_dtype=torch.bfloat16)
    assert not ll.qk_layernorm and not ll.add_qkv_bias and ll.bf16 and ll.params_dtype == torch.bfloat16


def test_rope_settings_reads_both_attribute_styles():
    hf = _hf("llama", rope_theta=500000.0)
    assert rope_settings(hf).base == 500000.0
    legacy = type("Cfg", (), dict(rope_theta=123.0, rope_scaling=None, rope_parameters=None))()
    assert rope_settings(legacy).base == 123.0
    scaled = type("Cfg", (), dict(rope_parameters=None, rope_theta=5e5, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)))()
    assert rope_settings(scaled).llama3_scaling_factor == 8.0


def test_unsupported_rope_is_refused_with_the_field():
    bad = type("Cfg", (), dict(rope_theta=5e5, rope_parameters=None, rope_scaling=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=4096)))()
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_settings(bad)
    yarn = type("Cfg", (), dict(rope_theta=1e4, rope_scaling=None,
                                rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)))()
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        rope_settings(yarn)


@pytest.mark.parametrize("parallel,field", [
    (ParallelConfig(tensor_model_parallel_size=3), "tensor_model_parallel_size=3 does not divide num_attention_heads"),
    (ParallelConfig(pipeline_model_parallel_size=3), "pipeline_model_parallel_size=3 does not divide num_hidden_layers"),
])
def test_impossible_layouts_are_refused_before_building(parallel, field):
    with pytest.raises(ValueError, match=field):
        transformer_config_from_hf(_hf("qwen2"), parallel=parallel)


def test_tp_must_divide_the_kv_heads_or_be_a_multiple_of_them():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 must divide num_key_value_heads=3"):
        transformer_config_from_hf(_hf("qwen2", num_attention_heads=6, num_key_value_heads=3, hidden_size=48),
                                   parallel=ParallelConfig(tensor_model_parallel_size=2))
    # 2 KV heads at TP = 4 (Qwen2.5-1.5B / 3B at TP = 4 / 8): megatron-core replicates the KV heads.
    check_parallel_fits_model(_hf("qwen2"), ParallelConfig(tensor_model_parallel_size=4), world_size=4)


def test_sizes_must_multiply_to_world_size():
    with pytest.raises(ValueError, match="world_size 6 is not divisible by tensor_model_parallel_size"):
        check_parallel_fits_model(_hf("qwen2"), ParallelConfig(tensor_model_parallel_size=2,
                                                               context_parallel_size=2), world_size=6)


def test_biases_megatron_cannot_place_are_refused():
    with pytest.raises(ValueError, match="attention_bias"):
        transformer_config_from_hf(_hf("llama", attention_bias=True), parallel=ParallelConfig())
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        check_parallel_fits_model(transformers.GPT2Config(), ParallelConfig())


def test_sequence_parallel_local_spec_tags_every_norm():
    """Under sequence parallelism the local spec's norms (input, pre-MLP, q/k, and the block's final
    norm) are torch norms whose parameters carry ``sequence_parallel`` (their gradients are partial sums
    over TP; megatron's ``finalize_model_grads`` adds them up); without it megatron's own ``WrappedTorchNorm``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_credit.models.gpt import SequenceParallelTorchNorm, gpt_decoder_block_spec, gpt_layer_spec

    cfg = transformer_config_from_hf(_hf("qwen3"), parallel=ParallelConfig(tensor_model_parallel_size=2,
                                                                             sequence_parallel=True))
    block = gpt_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=0)
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    assert block.layer_norm is SequenceParallelTorchNorm
    assert {layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm,
            attention.k_layernorm} == {SequenceParallelTorchNorm}
    norm = SequenceParallelTorchNorm(cfg, 16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    plain = transformer_config_from_hf(_hf("qwen3"), parallel=ParallelConfig(tensor_model_parallel_size=2))
    assert gpt_layer_spec(plain, use_transformer_engine=False).submodules.input_layernorm is WrappedTorchNorm


# ----------------------------------------------------------------- logits equal to transformers


@pytest.fixture(scope="module")
def world1():
    from megatron_credit import distributed

    distributed.initialize(ParallelConfig(), seed=0)
    yield
    distributed.destroy(process_group=True)


def _megatron_state_from_hf(hf_model, hf_config) -> dict:
    """The (test-only) HF -> megatron name map for TP=1: fused QKV per query group, [gate; up]."""
    sd = {k: v for k, v in hf_model.state_dict().items()}
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(hf_config.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."

        def qkv(kind):
            q = sd[p + f"self_attn.q_proj.{kind}"].reshape(groups, heads // groups * hd, -1)
            k = sd[p + f"self_attn.k_proj.{kind}"].reshape(groups, hd, -1)
            v = sd[p + f"self_attn.v_proj.{kind}"].reshape(groups, hd, -1)
            return torch.cat([q, k, v], dim=1).reshape(groups * (heads // groups + 2) * hd, -1).squeeze(-1)

        out[m + "self_attention.linear_qkv.weight"] = qkv("weight")
        if p + "self_attn.q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = qkv("bias")
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                     sd[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        if p + "self_attn.q_norm.weight" in sd:
            out[m + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
    return out


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2", dict(rope_theta=1e6, tie_word_embeddings=False)),
    ("qwen3", dict(rope_theta=1e6, head_dim=16, tie_word_embeddings=True)),
    ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192),
                   max_position_embeddings=16384, tie_word_embeddings=False)),
])
def test_logits_match_transformers(world1, model_type, extra):
    from megatron_credit.models import build_gpt_model

    hf_config = _hf(model_type, **extra)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # random norms and biases, so a misplaced one cannot hide
        for name, p in hf_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model = build_gpt_model(hf_config, transformer_config_from_hf(hf_config, parallel=ParallelConfig()))
    state = _megatron_state_from_hf(hf_model, hf_config)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(own) == set(state), set(own) ^ set(state)
    model.load_state_dict(state, strict=False)
    ids = torch.randint(0, hf_config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, -1)
    with torch.no_grad():
        expected = hf_model(input_ids=ids, position_ids=pos).logits
        got = model(ids, pos, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_sliding_window_attention_is_refused_with_the_field():
    hf = _hf("qwen2", use_sliding_window=True, sliding_window=32)
    with pytest.raises(ValueError, match=r"hf_config.use_sliding_window=True is not supported"):
        transformer_config_from_hf(hf, parallel=ParallelConfig())
    # Off (the Qwen2 default) builds as before.
    assert transformer_config_from_hf(_hf("qwen2", use_sliding_window=False),
                                      parallel=ParallelConfig()).num_layers == 2


def test_recipe_scalars_are_checked_against_the_dataclass_types():
    from megatron_credit.recipe.config import recipe_from_dict

    # PyYAML reads 1e-6 (no dot) as a string: float fields convert numeric strings.
    r = recipe_from_dict({}, overrides=["optim.lr=1e-6"])
    assert r.optim.lr == 1e-6 and isinstance(r.optim.lr, float)
    assert recipe_from_dict({"optim": {"lr": 1}}).optim.lr == 1.0
    assert isinstance(recipe_from_dict({"optim": {"lr": 1}}).optim.lr, float)
    bad = [({"optim": {"lr": "fast"}}, r"optim\.lr must be a number, got 'fast' \(str\)"),
           ({"optim": {"lr": True}}, r"optim\.lr must be a number, got True \(bool\)"),
           ({"train": {"steps": "8"}}, r"train\.steps must be an int, got '8' \(str\)"),
           ({"train": {"steps": True}}, r"train\.steps must be an int, got True \(bool\)"),
           ({"train": {"steps": 2.0}}, r"train\.steps must be an int"),
           ({"parallel": {"sequence_parallel": 1}}, r"parallel\.sequence_parallel must be a bool"),
           ({"parallel": {"tensor_model_parallel_size": "2"}},
            r"parallel\.tensor_model_parallel_size must be an int"),
           ({"seed": "x"}, r"^seed must be an int"),
           ({"model": {"params_dtype": 16, "architecture": {"model_type": "qwen2"}}},
            r"model\.params_dtype must be a string")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            recipe_from_dict(data)
    # Optional fields accept None and their type.
    r = recipe_from_dict({"model": {"name_or_path": None, "architecture": {"model_type": "qwen2"}}})
    assert r.model.name_or_path is None


# ------------------------------------------------------- checkpoint loads skip init, keep TP attributes
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _tp_attributes(model) -> dict:
    return {name: tuple(getattr(p, a, None) for a in _TP_ATTRS) for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("qwen3", dict(tie_word_embeddings=True))])
def test_skipping_init_keeps_megatrons_tensor_parallel_attributes(world1, monkeypatch, model_type, extra):
    import megatron.core.tensor_parallel.layers as layers

    from megatron_credit.models import build_gpt_model

    hf_config = _hf(model_type, **extra)
    initialised = build_gpt_model(hf_config, transformer_config_from_hf(hf_config, parallel=ParallelConfig()))
    want = _tp_attributes(initialised)
    assert want["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2)  # megatron's gated fc1 stride
    assert want["decoder.layers.0.self_attention.linear_proj.weight"] == (True, 1, 1)
    assert want["embedding.word_embeddings.weight"] == (True, 0, 1)

    def no_random_init(*args, **kwargs):
        raise AssertionError("random initialisation ran for a model whose weights come from a checkpoint")

    monkeypatch.setattr(layers, "_initialize_affine_weight_cpu", no_random_init)
    monkeypatch.setattr(layers, "_initialize_affine_weight_gpu", no_random_init)
    skipped = build_gpt_model(hf_config, transformer_config_from_hf(hf_config, parallel=ParallelConfig(),
                                                                    perform_initialization=False))
    assert _tp_attributes(skipped) == want


# ----------------------------------------------------------------- dtype, overrides, spec, lengths
def test_params_dtype_auto_is_the_checkpoints_on_gpu_and_fp32_on_cpu(tmp_path):
    transformers.Qwen2Config(**TINY, dtype="bfloat16").save_pretrained(tmp_path)
    auto = ModelConfig(name_or_path=str(tmp_path))
    assert auto.params_dtype == "auto"
    assert auto.torch_dtype(cuda=True) == torch.bfloat16 and auto.torch_dtype(cuda=False) == torch.float32
    assert ModelConfig(name_or_path=str(tmp_path), params_dtype="float32").torch_dtype(cuda=True) == torch.float32
    assert ModelConfig(architecture=dict(model_type="qwen2", **TINY)).torch_dtype(cuda=True) == torch.float32
    with pytest.raises(ValueError, match="model.params_dtype must be 'auto' or one of"):
        ModelConfig(architecture=dict(model_type="qwen2"), params_dtype="fp8")


def test_max_position_and_rope_theta_overrides_reach_the_model(tmp_path):
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.models import check_sequence_length

    transformers.Qwen2Config(**{**TINY, "max_position_embeddings": 4096}, rope_theta=1e4).save_pretrained(tmp_path)
    plain = ModelConfig(name_or_path=str(tmp_path)).hf_config()
    with pytest.raises(ValueError, match="20480 tokens is longer than the model's max_position_embeddings=4096"):
        check_sequence_length(plain, 20480)
    recipe = recipe_from_dict({"model": {"name_or_path": str(tmp_path)}},
                              overrides=["model.max_position_embeddings=32768", "model.rope_theta=1000000"])
    raised = recipe.model.hf_config()
    check_sequence_length(raised, 20480)
    assert raised.max_position_embeddings == 32768 and rope_settings(raised).base == 1e6
    assert rope_settings(plain).base == 1e4
    tc = transformer_config_from_hf(raised, parallel=ParallelConfig())
    assert tc.num_layers == 2
    for bad, match in [(dict(max_position_embeddings=0), "max_position_embeddings must be >= 1"),
                       (dict(rope_theta=-1.0), "rope_theta must be > 0"),
                       (dict(transformer_impl="te"), "transformer_impl must be one of")]:
        with pytest.raises(ValueError, match=match):
            recipe_from_dict({"model": {"name_or_path": str(tmp_path), **bad}})


def test_local_spec_on_gpu_only_when_asked(monkeypatch):
    from megatron_credit.models import gpt, use_transformer_engine_spec

    assert [ModelConfig(architecture=dict(model_type="qwen2"), transformer_impl=t).use_transformer_engine()
            for t in ("auto", "transformer_engine", "local")] == [None, True, False]
    with pytest.raises(ValueError, match="model.transformer_impl=local"):
        use_transformer_engine_spec(None, cuda=True, te_available=False)
    assert use_transformer_engine_spec(None, cuda=True, te_available=True) is True
    assert use_transformer_engine_spec(False, cuda=True, te_available=True) is False
    with pytest.raises(ValueError, match="not importable"):
        use_transformer_engine_spec(True, cuda=False, te_available=False)
    # gpt_layer_spec applies it: a GPU without TE refuses "auto" instead of falling back silently.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "transformer_engine_available", lambda: False)
    tc = transformer_config_from_hf(_hf("qwen2"), parallel=ParallelConfig())
    with pytest.raises(ValueError, match="Transformer Engine is not importable"):
        gpt.gpt_layer_spec(tc)
    assert gpt.gpt_layer_spec(tc, use_transformer_engine=False) is not None
