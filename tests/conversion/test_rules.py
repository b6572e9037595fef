"""The declarative conversion rules on CPU: family lookup, model dims and parallel refusals,
the rule tables of each family, every typed transform forward and back at TP = 1, 2, 4, and the
streaming iterators' order and exact tensors.

Every tensor here is unique-valued (``arange`` with a running offset), so a transform that picks the
wrong head, group, half or rank, or a rule that maps the wrong HF tensor of the same shape (``q_norm``
<-> ``k_norm``, ``gate`` <-> ``up``, ``k`` <-> ``v`` biases), gives a different tensor. The expected
megatron tensors are written out here from the row-order descriptions (``transforms`` module docstring),
not computed with the library's own transforms. Configs are plain namespaces where an attribute must be
absent (inline recipe configs carry no ``architectures``; older configs no ``num_key_value_heads``,
``head_dim``, ``tie_word_embeddings`` or bias flags); one test checks the name tables against the
models ``transformers`` builds.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import megatron_credit.conversion.transforms as transforms_module
from megatron_credit.conversion import FAMILIES, check_hf_keys, family_for_config, supported_architectures
from megatron_credit.conversion.base import ModelDims
from megatron_credit.families.base import Family, Kind, Rule, _always, register_family
from megatron_credit.families.dense_rules import EMBEDDING, INPUT_NORM, OUTPUT, proj_bias, qkv_bias
from megatron_credit.conversion.streaming import (expand_rules, iter_hf_from_megatron, iter_megatron_from_hf,
                                                  rule_to_hf, rule_to_megatron)
from megatron_credit.conversion.transforms import (TPSplit, fuse_gate_up, fuse_qkv, pad_rows, split_gate_up,
                                                   split_qkv, tp_gather, tp_shard)

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}
SUPPORTED = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
ABSENT = object()


def _cfg(family: str = "llama", **kw):
    """A small config as a namespace; ``ABSENT`` leaves an attribute out. head_dim (6) != hidden / heads."""
    base = dict(architectures=[ARCH[family]], model_type=family, num_hidden_layers=2, hidden_size=16,
                num_attention_heads=4, num_key_value_heads=2, head_dim=6, intermediate_size=10,
                vocab_size=37, tie_word_embeddings=False)
    base.update(kw)
    return SimpleNamespace(**{k: v for k, v in base.items() if v is not ABSENT})


class _Unique:
    """Tensors whose elements are distinct across every tensor drawn from one instance (exact integers:
    bfloat16 is only used for the first 256)."""

    def __init__(self, dtype=torch.float64):
        self.next, self.dtype = 1, dtype

    def __call__(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        t = torch.arange(self.next, self.next + n, dtype=self.dtype).reshape(shape)
        self.next += n
        assert self.dtype == torch.float64 or self.next <= 257, "bfloat16 holds integers exactly up to 256"
        return t


# --- expected tensors, written out from the docstrings -------------------------------------------
from tests.references import qkv_reference  # noqa: E402  (one loop reference of the QKV row order)


def _flags(family, c):
    attn = bool(getattr(c, "attention_bias", False))
    qkv_b = family == "qwen2" or (family in ("llama", "qwen3") and attn)
    o_b = family in ("llama", "qwen3") and attn
    mlp_b = family == "llama" and bool(getattr(c, "mlp_bias", False))
    return qkv_b, o_b, mlp_b


def _hf_shapes(family, c) -> dict[str, tuple[int, ...]]:
    H, G, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hid, ffn, V = c.hidden_size, c.intermediate_size, c.vocab_size
    qkv_b, o_b, mlp_b = _flags(family, c)
    s = {"model.embed_tokens.weight": (V, hid)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (hid,)
        s[p + "self_attn.q_proj.weight"] = (H * d, hid)
        s[p + "self_attn.k_proj.weight"] = (G * d, hid)
        s[p + "self_attn.v_proj.weight"] = (G * d, hid)
        s[p + "self_attn.o_proj.weight"] = (hid, H * d)
        if qkv_b:
            s[p + "self_attn.q_proj.bias"], s[p + "self_attn.k_proj.bias"] = (H * d,), (G * d,)
            s[p + "self_attn.v_proj.bias"] = (G * d,)
        if o_b:
            s[p + "self_attn.o_proj.bias"] = (hid,)
        if family == "qwen3":
            s[p + "self_attn.q_norm.weight"], s[p + "self_attn.k_norm.weight"] = (d,), (d,)
        s[p + "post_attention_layernorm.weight"] = (hid,)
        s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"] = (ffn, hid), (ffn, hid)
        s[p + "mlp.down_proj.weight"] = (hid, ffn)
        if mlp_b:
            s[p + "mlp.gate_proj.bias"], s[p + "mlp.up_proj.bias"] = (ffn,), (ffn,)
            s[p + "mlp.down_proj.bias"] = (hid,)
    s["model.norm.weight"] = (hid,)
    if not getattr(c, "tie_word_embeddings", False):
        s["lm_head.weight"] = (V, hid)
    return s


def _hf_state(family, c):
    u = _Unique()
    return {k: u(*shape) for k, shape in _hf_shapes(family, c).items()}


def _expected_megatron(family, c, hf, *, fused=False):
    """``[(global megatron name, tensor, kind, tp split)]`` in the order the iterators yield them."""
    H, G, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qkv_b, o_b, mlp_b = _flags(family, c)
    out = [("embedding.word_embeddings.weight", hf["model.embed_tokens.weight"], Kind.VOCAB, TPSplit.ROWS)]
    for i in range(c.num_hidden_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.append((m + ("self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"),
                    hf[p + "input_layernorm.weight"], Kind.COPY, TPSplit.REPLICATED))
        for kind in ("weight", "bias") if qkv_b else ("weight",):
            qkv = qkv_reference(*(hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"), H, G, d)
            out.append((m + f"self_attention.linear_qkv.{kind}", qkv, Kind.QKV, TPSplit.ROWS))
        if family == "qwen3":
            out.append((m + "self_attention.q_layernorm.weight", hf[p + "self_attn.q_norm.weight"], Kind.COPY,
                        TPSplit.REPLICATED))
            out.append((m + "self_attention.k_layernorm.weight", hf[p + "self_attn.k_norm.weight"], Kind.COPY,
                        TPSplit.REPLICATED))
        out.append((m + "self_attention.linear_proj.weight", hf[p + "self_attn.o_proj.weight"], Kind.COPY,
                    TPSplit.COLS))
        if o_b:
            out.append((m + "self_attention.linear_proj.bias", hf[p + "self_attn.o_proj.bias"], Kind.COPY,
                        TPSplit.REPLICATED))
        out.append((m + ("mlp.linear_fc1.layer_norm_weight" if fused else "pre_mlp_layernorm.weight"),
                    hf[p + "post_attention_layernorm.weight"], Kind.COPY, TPSplit.REPLICATED))
        mlp = [("weight", TPSplit.COLS)] + ([("bias", TPSplit.REPLICATED)] if mlp_b else [])
        for kind, _ in mlp:
            out.append((m + f"mlp.linear_fc1.{kind}", torch.cat([hf[p + f"mlp.gate_proj.{kind}"],
                                                                   hf[p + f"mlp.up_proj.{kind}"]]),
                        Kind.GATE_UP, TPSplit.GATED_ROWS))
        for kind, split in mlp:  # fc2's bias is added after the all-reduce: replicated
            out.append((m + f"mlp.linear_fc2.{kind}", hf[p + f"mlp.down_proj.{kind}"], Kind.COPY, split))
    out.append(("decoder.final_layernorm.weight", hf["model.norm.weight"], Kind.COPY, TPSplit.REPLICATED))
    if not getattr(c, "tie_word_embeddings", False):
        out.append(("output_layer.weight", hf["lm_head.weight"], Kind.VOCAB, TPSplit.ROWS))
    return out


# --- family lookup ---------------------------------------------------------------------------------
def test_supported_architectures_are_the_four_families():
    assert supported_architectures() == SUPPORTED
    assert list(FAMILIES) == ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("family", sorted(ARCH))
def test_family_by_architecture_and_by_model_type_alone(family):
    want = FAMILIES.get(family)
    assert family_for_config(SimpleNamespace(architectures=[ARCH[family]])) is want
    # the architecture wins over a model_type naming another family
    other = "qwen2" if family != "qwen2" else "llama"
    assert family_for_config(SimpleNamespace(architectures=[ARCH[family]], model_type=other)) is want
    # any listed architecture that a family handles selects it
    assert family_for_config(SimpleNamespace(architectures=["GPT2LMHeadModel", ARCH[family]])) is want
    # inline (recipe) configs name no class: no attribute, None, or an empty list
    for archs in (ABSENT, None, []):
        cfg = _cfg(family, architectures=archs)
        assert family_for_config(cfg) is want, archs


@pytest.mark.parametrize("cfg,archs,model_type", [
    (SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="llama"), "['GPT2LMHeadModel']", "'llama'"),
    (SimpleNamespace(architectures=["GPT2LMHeadModel", "Foo"], model_type="gpt2"), "['GPT2LMHeadModel', 'Foo']",
     "'gpt2'"),
    (SimpleNamespace(model_type="gpt2"), "None", "'gpt2'"),
    (SimpleNamespace(architectures=[], model_type="gpt2"), "None", "'gpt2'"),
    (object(), "None", "None"),
])
def test_unknown_architecture_names_it_and_lists_the_supported(cfg, archs, model_type):
    msg = f"unsupported architecture {archs} (model_type={model_type}); supported: {SUPPORTED}"
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        family_for_config(cfg)


def test_register_family_adds_a_lookup_and_refuses_duplicates(monkeypatch):
    monkeypatch.setattr(FAMILIES, "_items", dict(FAMILIES._items))  # restored after the test
    fam = Family(name="tiny-test", architectures=("TinyForCausalLM",), rules=(EMBEDDING,))
    assert register_family(fam) is fam
    assert FAMILIES.get("tiny-test") is fam
    assert family_for_config(SimpleNamespace(architectures=["TinyForCausalLM"])) is fam
    assert supported_architectures() == sorted(SUPPORTED + ["TinyForCausalLM"])
    with pytest.raises(ValueError, match="model family 'tiny-test' is already registered"):
        register_family(Family(name="tiny-test", architectures=(), rules=()))


# --- model dims -------------------------------------------------------------------------------------
def test_model_dims_read_every_field():
    cfg = SimpleNamespace(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                          head_dim=10, intermediate_size=20, vocab_size=77, tie_word_embeddings=1)
    dims = ModelDims.from_hf_config(cfg)
    assert dims == ModelDims(num_layers=3, hidden_size=48, num_heads=6, num_query_groups=2, head_dim=10,
                             ffn_hidden_size=20, vocab_size=77, tie_word_embeddings=True)
    assert dims.tie_word_embeddings is True


@pytest.mark.parametrize("absent", [ABSENT, None])
def test_model_dims_defaults_for_absent_fields(absent):
    """No KV heads: one group per head (MHA); no head_dim: hidden // heads; no tie flag: untied."""
    kw = dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, intermediate_size=20, vocab_size=77)
    if absent is None:
        kw.update(num_key_value_heads=None, head_dim=None)
    dims = ModelDims.from_hf_config(SimpleNamespace(**kw))
    assert dims == ModelDims(num_layers=3, hidden_size=48, num_heads=6, num_query_groups=6, head_dim=8,
                             ffn_hidden_size=20, vocab_size=77, tie_word_embeddings=False)
    assert type(dims.head_dim) is int and dims.tie_word_embeddings is False


def _dims(**kw):
    base = dict(num_layers=4, hidden_size=16, num_heads=4, num_query_groups=2, head_dim=2, ffn_hidden_size=8,
                vocab_size=16, tie_word_embeddings=False)
    base.update(kw)
    return ModelDims(**base)


@pytest.mark.parametrize("dims,tp,pp", [
    (_dims(), 1, 1), (_dims(), 2, 4), (_dims(), 4, 2),   # TP = 4 a multiple of the 2 KV heads
    (_dims(num_heads=8, num_query_groups=4), 2, 1),      # TP divides the groups
    (_dims(num_query_groups=2, head_dim=1), 4, 1),       # (4 + 2*2) * 1 = 8 rows over 4 ranks
    (_dims(num_query_groups=1, head_dim=2), 4, 1),       # (4 + 2*1) * 2 = 12 rows over 4 ranks
])
def test_parallel_sizes_that_split_evenly_are_accepted(dims, tp, pp):
    dims.check_parallel(tp=tp, pp=pp)


@pytest.mark.parametrize("dims,tp,pp,msg", [
    (_dims(), 0, 1, "tp and pp must be >= 1, got tp=0, pp=1"),
    (_dims(), 1, 0, "tp and pp must be >= 1, got tp=1, pp=0"),
    (_dims(), -2, 1, "tp and pp must be >= 1, got tp=-2, pp=1"),
    (_dims(num_heads=6, num_query_groups=6, vocab_size=12, ffn_hidden_size=12), 4, 1,
     "tp=4 does not divide num_attention_heads=6"),
    (_dims(num_heads=12, num_query_groups=3, vocab_size=12, ffn_hidden_size=12), 2, 1,
     "tp=2 must divide the query groups (num_key_value_heads=3) or be a multiple of them"),
    (_dims(num_query_groups=1, head_dim=1), 4, 1,
     "tp=4 does not divide the rows of linear_qkv ((heads + 2 * groups) * head_dim = 6)"),
    (_dims(vocab_size=18), 4, 1,
     "tp=4 does not divide vocab_size=18 (the models are built without vocabulary padding)"),
    (_dims(ffn_hidden_size=10), 4, 1, "tp=4 does not divide intermediate_size=10"),
    (_dims(num_layers=6), 1, 4, "pp=4 does not divide num_hidden_layers=6"),
])
def test_parallel_sizes_that_split_unevenly_are_refused(dims, tp, pp, msg):
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        dims.check_parallel(tp=tp, pp=pp)


# --- the rules -------------------------------------------------------------------------------------
def test_bias_rules():
    L, M = "model.layers.{i}.", "decoder.layers.{i}."
    assert qkv_bias() == Rule(megatron=M + "self_attention.linear_qkv.bias",
                              hf=(L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias",
                                  L + "self_attn.v_proj.bias"), kind=Kind.QKV, tp=TPSplit.ROWS, when=_always)
    assert proj_bias() == Rule(megatron=M + "self_attention.linear_proj.bias", hf=(L + "self_attn.o_proj.bias",),
                               kind=Kind.COPY, tp=TPSplit.REPLICATED, when=_always)
    assert _always(None) is True

    def flag(cfg):
        return cfg.flag

    assert qkv_bias(when=flag).when is flag and proj_bias(when=flag).when is flag


def test_rule_names_under_the_te_spec():
    assert INPUT_NORM.megatron_name(fused_norms=False) == "decoder.layers.{i}.input_layernorm.weight"
    assert (INPUT_NORM.megatron_name(fused_norms=True)
            == "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight")
    for fused in (False, True):  # no TE name: the same under both specs
        assert EMBEDDING.megatron_name(fused_norms=fused) == "embedding.word_embeddings.weight"
    assert INPUT_NORM.per_layer and not EMBEDDING.per_layer


def test_active_rules_read_the_config():
    fam = FAMILIES.get("qwen2")
    assert OUTPUT in fam.active_rules(_cfg("qwen2"))
    tied = fam.active_rules(_cfg("qwen2", tie_word_embeddings=True))
    assert OUTPUT not in tied and tied == [r for r in fam.rules if r is not OUTPUT]


CASES = {  # family, config overrides
    "llama": ("llama", {}),
    "llama-no-flags": ("llama", {"attention_bias": ABSENT, "mlp_bias": ABSENT}),
    "llama-attn-bias": ("llama", {"attention_bias": True, "mlp_bias": False}),
    "llama-mlp-bias": ("llama", {"attention_bias": False, "mlp_bias": True}),
    "llama-both-tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-mha": ("qwen2", {"num_key_value_heads": 4, "num_hidden_layers": 3}),
    "qwen3": ("qwen3", {}),
    "qwen3-attn-bias": ("qwen3", {"attention_bias": True}),
    "qwen3-tied-no-tie-flag": ("qwen3", {"attention_bias": False, "tie_word_embeddings": ABSENT}),
    "mistral": ("mistral", {}),
    "mistral-tied": ("mistral", {"tie_word_embeddings": True}),
}


def _case(name):
    family, kw = CASES[name]
    return family, FAMILIES.get(family), _cfg(family, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_expand_rules_lists_every_parameter_in_order(case, fused):
    """Embedding first, then every layer's rules in table order, then the final norm and the head."""
    family, fam, cfg = _case(case)
    hf = _hf_state(family, cfg)
    want = _expected_megatron(family, cfg, hf, fused=fused)
    got = expand_rules(fam, cfg, fused_norms=fused)
    assert [n for n, _, _ in got] == [n for n, *_ in want]
    assert [(r.kind, r.tp) for _, _, r in got] == [(k, tp) for _, _, k, tp in want]
    # the HF names of a rule are those of its own layer, in the transform's order
    assert sorted(h for _, hs, _ in got for h in hs) == sorted(hf)
    for name, hs, _ in got:
        if name.startswith("decoder.layers."):
            i = name.split(".")[2]
            assert all(h.startswith(f"model.layers.{i}.") for h in hs), (name, hs)
    if not fused:
        assert expand_rules(fam, cfg) == got  # the local spec is the default


def test_te_names_apply_to_every_rule_that_has_one():
    """The TE spec's name is used for any rule that declares one, not only for per-layer norms."""
    pre = Rule(megatron="embedding.word_embeddings.weight", te_megatron="embedding.te.weight",
               hf=("model.embed_tokens.weight",), kind=Kind.VOCAB, tp=TPSplit.ROWS)
    norm = Rule(megatron="decoder.layers.{i}.input_layernorm.weight", te_megatron="decoder.layers.{i}.te_norm",
                hf=("model.layers.{i}.input_layernorm.weight",), kind=Kind.COPY, tp=TPSplit.REPLICATED)
    post = Rule(megatron="decoder.final_layernorm.weight", te_megatron="decoder.final_te.weight",
                hf=("model.norm.weight",), kind=Kind.COPY, tp=TPSplit.REPLICATED)
    fam = Family(name="te-test", architectures=(), rules=(post, norm, pre))
    cfg = _cfg("llama")
    assert expand_rules(fam, cfg, fused_norms=True) == [
        ("embedding.te.weight", ("model.embed_tokens.weight",), pre),
        ("decoder.layers.0.te_norm", ("model.layers.0.input_layernorm.weight",), norm),
        ("decoder.layers.1.te_norm", ("model.layers.1.input_layernorm.weight",), norm),
        ("decoder.final_te.weight", ("model.norm.weight",), post)]
    assert [n for n, _, _ in expand_rules(fam, cfg)] == [
        "embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.1.input_layernorm.weight", "decoder.final_layernorm.weight"]


def test_expand_rules_qkv_and_fc1_take_their_hf_tensors_in_order():
    got = {n: hs for n, hs, _ in expand_rules(FAMILIES.get("llama"), _cfg("llama", mlp_bias=True))}
    assert got["decoder.layers.1.self_attention.linear_qkv.weight"] == tuple(
        f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    assert got["decoder.layers.1.mlp.linear_fc1.bias"] == ("model.layers.1.mlp.gate_proj.bias",
                                                           "model.layers.1.mlp.up_proj.bias")
    assert got["output_layer.weight"] == ("lm_head.weight",)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bias_flags_absent_mean_no_biases(family):
    names = [n for n, _, _ in expand_rules(FAMILIES.get(family), _cfg(family, attention_bias=ABSENT,
                                                                         mlp_bias=ABSENT))]
    assert not [n for n in names if n.endswith(".bias")]
    with_bias = [n for n, _, _ in expand_rules(FAMILIES.get(family), _cfg(family, attention_bias=True))]
    assert [n for n in with_bias if n.endswith(".bias")] == [
        f"decoder.layers.{i}.self_attention.{p}.bias" for i in range(2) for p in ("linear_qkv", "linear_proj")]


@pytest.mark.parametrize("family", sorted(ARCH))
def test_mlp_bias_is_a_llama_flag(family):
    names = [n for n, _, _ in expand_rules(FAMILIES.get(family), _cfg(family, mlp_bias=True))]
    assert ("decoder.layers.0.mlp.linear_fc1.bias" in names) == (family == "llama")
    assert ("decoder.layers.1.mlp.linear_fc2.bias" in names) == (family == "llama")


# --- check_hf_keys -----------------------------------------------------------------------------------
def test_check_hf_keys_accepts_complete_checkpoints_and_ignorable_extras():
    fam, cfg = FAMILIES.get("llama"), _cfg("llama")
    keys = set(_hf_shapes("llama", cfg))
    check_hf_keys(keys, fam, cfg)
    check_hf_keys(iter(sorted(keys)), fam, cfg)  # any iterable of names
    check_hf_keys(keys | {"model.layers.0.self_attn.rotary_emb.inv_freq",
                          "model.layers.1.self_attn.rotary_emb.inv_freq"}, fam, cfg)
    tied = _cfg("llama", tie_word_embeddings=True)
    tied_keys = set(_hf_shapes("llama", tied))
    assert "lm_head.weight" not in tied_keys
    check_hf_keys(tied_keys, fam, tied)
    check_hf_keys(tied_keys | {"lm_head.weight"}, fam, tied)  # a tied checkpoint may still store the head
    no_flag = _cfg("qwen3", tie_word_embeddings=ABSENT)  # no tie flag: untied, the head is needed
    check_hf_keys(set(_hf_shapes("qwen3", no_flag)), FAMILIES.get("qwen3"), no_flag)


def test_check_hf_keys_names_missing_tensors():
    fam, cfg = FAMILIES.get("llama"), _cfg("llama")
    keys = set(_hf_shapes("llama", cfg))
    with pytest.raises(ValueError, match="^" + re.escape(
            "1 tensors missing from the HF checkpoint for family 'llama', e.g. ['lm_head.weight']") + "$"):
        check_hf_keys(keys - {"lm_head.weight"}, fam, cfg)
    layer1 = sorted(k for k in keys if k.startswith("model.layers.1."))
    assert len(layer1) == 9
    with pytest.raises(ValueError, match="^" + re.escape(
            f"9 tensors missing from the HF checkpoint for family 'llama', e.g. {layer1[:5]}") + "$"):
        check_hf_keys(keys - set(layer1), fam, cfg)
    biased = _cfg("llama", attention_bias=True)  # the flag makes the biases required
    with pytest.raises(ValueError, match=re.escape("8 tensors missing") + ".*" +
                       re.escape("'model.layers.0.self_attn.k_proj.bias'")):
        check_hf_keys(keys, fam, biased)


def test_check_hf_keys_names_tensors_that_would_be_lost():
    fam, cfg = FAMILIES.get("qwen2"), _cfg("qwen2")
    keys = set(_hf_shapes("qwen2", cfg))
    extra = [f"model.layers.{i}.mlp.extra{j}.weight" for i in range(2) for j in range(3)] + ["lm_head.bias"]
    with pytest.raises(ValueError, match="^" + re.escape(
            f"7 HF tensors have no rule in family 'qwen2' (they would be lost), e.g. {sorted(extra)[:5]}") + "$"):
        check_hf_keys(keys | set(extra), fam, cfg)
    tied = _cfg("qwen2", tie_word_embeddings=True)  # only the tied head is ignorable, not its bias
    with pytest.raises(ValueError, match="^" + re.escape(
            "1 HF tensors have no rule in family 'qwen2' (they would be lost), e.g. ['lm_head.bias']") + "$"):
        check_hf_keys(set(_hf_shapes("qwen2", tied)) | {"lm_head.weight", "lm_head.bias"}, fam, tied)


# --- streaming --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_megatron_from_hf_yields_exact_tensors_in_order_reading_each_once(case, fused):
    family, fam, cfg = _case(case)
    hf = _hf_state(family, cfg)
    reads = []

    def get(name):
        reads.append(name)
        return hf[name]

    got = list(iter_megatron_from_hf(get, fam, cfg, fused_norms=fused) if fused
               else iter_megatron_from_hf(get, fam, cfg))
    want = _expected_megatron(family, cfg, hf, fused=fused)
    assert [n for n, _ in got] == [n for n, *_ in want]
    for (name, t), (_, w, _, _) in zip(got, want):
        assert t.dtype == w.dtype and torch.equal(t, w), name
    assert reads == [h for _, hs, _ in expand_rules(fam, cfg) for h in hs]
    assert sorted(reads) == sorted(hf)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True])
def test_hf_from_megatron_inverts_it_and_drops_vocab_padding(case, fused):
    family, fam, cfg = _case(case)
    hf = _hf_state(family, cfg)
    mc = {n: t for n, t, _, _ in _expected_megatron(family, cfg, hf, fused=fused)}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in mc:  # megatron pads the vocabulary: rows past vocab_size are dropped
            mc[name] = torch.cat([mc[name], torch.full((11, cfg.hidden_size), -1.0, dtype=mc[name].dtype)])
    reads = []

    def get(name):
        reads.append(name)
        return mc[name]

    got = list(iter_hf_from_megatron(get, fam, cfg, fused_norms=fused) if fused
               else iter_hf_from_megatron(get, fam, cfg))
    assert [n for n, _ in got] == [h for _, hs, _ in expand_rules(fam, cfg) for h in hs]
    assert reads == list(mc)
    for name, t in got:
        assert t.dtype == hf[name].dtype and torch.equal(t, hf[name]), name
        assert t.is_contiguous(), name


def test_vocab_rows_short_of_the_vocabulary_are_refused():
    fam, cfg = FAMILIES.get("llama"), _cfg("llama")  # vocab 37 > hidden 16
    hf = _hf_state("llama", cfg)
    mc = {n: t for n, t, _, _ in _expected_megatron("llama", cfg, hf)}
    mc["output_layer.weight"] = mc["output_layer.weight"][:36]
    with pytest.raises(ValueError, match="^" + re.escape("output_layer.weight: 36 rows < vocab_size=37") + "$"):
        list(iter_hf_from_megatron(mc.__getitem__, fam, cfg))
    dims = ModelDims.from_hf_config(cfg)
    exact = hf["model.embed_tokens.weight"]
    (back,) = rule_to_hf(EMBEDDING, exact, dims)
    assert torch.equal(back, exact)
    with pytest.raises(ValueError, match="^" + re.escape("embedding.word_embeddings.weight: 5 rows < vocab_size=37")):
        rule_to_hf(EMBEDDING, exact[:5], dims)


def test_megatron_tensors_are_unpadded_and_copies_are_the_hf_tensor():
    cfg = _cfg("llama")
    dims = ModelDims.from_hf_config(cfg)
    hf = _hf_state("llama", cfg)
    emb = hf["model.embed_tokens.weight"]
    assert rule_to_megatron(EMBEDDING, [emb], dims) is emb
    norm = hf["model.layers.0.input_layernorm.weight"]
    assert rule_to_megatron(INPUT_NORM, [norm], dims) is norm
    assert rule_to_hf(INPUT_NORM, norm, dims) == [norm]


def test_qkv_shape_errors_name_the_tensor_being_converted():
    fam, cfg = FAMILIES.get("llama"), _cfg("llama")
    hf = _hf_state("llama", cfg)
    bad = dict(hf)
    bad["model.layers.1.self_attn.k_proj.weight"] = hf["model.layers.1.self_attn.k_proj.weight"][:6]
    with pytest.raises(ValueError, match="^" + re.escape(
            "decoder.layers.1.self_attention.linear_qkv.weight: q/k/v rows 24/6/12 do not match heads=4, groups=2, "
            "head_dim=6") + "$"):
        list(iter_megatron_from_hf(bad.__getitem__, fam, cfg))
    mc = {n: t for n, t, _, _ in _expected_megatron("llama", cfg, hf)}
    qkv1 = "decoder.layers.1.self_attention.linear_qkv.weight"
    mc[qkv1] = mc[qkv1][:40]
    with pytest.raises(ValueError, match="^" + re.escape(
            "decoder.layers.1.self_attention.linear_qkv.weight has 40 rows, expected (H + 2G) * d = 48") + "$"):
        list(iter_hf_from_megatron(mc.__getitem__, fam, cfg))
    # without a name, the rule's (templated) name
    dims = ModelDims.from_hf_config(cfg)
    qkv_rule = [r for _, _, r in expand_rules(fam, cfg) if r.kind is Kind.QKV][0]
    with pytest.raises(ValueError, match="^" + re.escape("decoder.layers.{i}.self_attention.linear_qkv.weight: q/k/v")):
        rule_to_megatron(qkv_rule, [torch.zeros(24, 16), torch.zeros(6, 16), torch.zeros(12, 16)], dims)
    with pytest.raises(ValueError, match="^" + re.escape("decoder.layers.{i}.self_attention.linear_qkv.weight has 40")):
        rule_to_hf(qkv_rule, torch.zeros(40, 16), dims)


def test_a_rule_whose_transform_returns_fewer_tensors_than_its_hf_names_is_refused():
    """A (mis)declared rule must not silently drop an HF tensor on export."""
    rule = Rule(megatron="decoder.final_layernorm.weight", hf=("model.norm.weight", "model.norm2.weight"),
                kind=Kind.COPY, tp=TPSplit.REPLICATED)
    fam = Family(name="broken", architectures=(), rules=(rule,))
    cfg = _cfg("llama")
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter than argument 1"):
        list(iter_hf_from_megatron({"decoder.final_layernorm.weight": torch.ones(16)}.__getitem__, fam, cfg))
    with pytest.raises(ValueError, match="too many values to unpack"):
        list(iter_megatron_from_hf({"model.norm.weight": torch.ones(16),
                                    "model.norm2.weight": torch.ones(16)}.__getitem__, fam, cfg))


# --- transforms: fused QKV --------------------------------------------------------------------------
QKV_SHAPES = [(8, 4, 3), (8, 2, 3), (8, 1, 2), (4, 4, 2), (6, 3, 1)]  # heads, groups, head_dim


@pytest.mark.parametrize("heads,groups,d", QKV_SHAPES)
@pytest.mark.parametrize("rest", [(), (5,)])
def test_fuse_qkv_groups_rows_per_query_group_and_splits_back(heads, groups, d, rest):
    u = _Unique(torch.bfloat16 if rest == () else torch.float64)
    q, k, v = u(heads * d, *rest), u(groups * d, *rest), u(groups * d, *rest)
    fused = fuse_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=d)
    assert fused.dtype == q.dtype and torch.equal(fused, qkv_reference(q, k, v, heads, groups, d))
    back = split_qkv(fused, num_heads=heads, num_query_groups=groups, head_dim=d)
    assert len(back) == 3
    for got, want in zip(back, (q, k, v)):
        assert got.shape == want.shape and torch.equal(got, want) and got.is_contiguous()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_qkv_tp_shards_are_contiguous_row_blocks_holding_whole_or_partial_groups(tp, groups):
    """TP divides the groups: rank r holds the fused tensor of its own heads and groups. TP a multiple
    of the groups: rank r holds a contiguous part of group ``r // (tp / groups)``."""
    heads, d, hidden = 8, 2, 5
    u = _Unique()
    for rest in ((hidden,), ()):  # the weight and the bias
        q, k, v = u(heads * d, *rest), u(groups * d, *rest), u(groups * d, *rest)
        fused = fuse_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=d)
        ref = qkv_reference(q, k, v, heads, groups, d)
        rows = ref.shape[0] // tp
        shards = [tp_shard(fused, TPSplit.ROWS, rank=r, size=tp) for r in range(tp)]
        for r, shard in enumerate(shards):
            assert torch.equal(shard, ref[r * rows:(r + 1) * rows])
            if groups % tp == 0:
                hq, gq = heads // tp * d, groups // tp * d
                want = qkv_reference(q[r * hq:(r + 1) * hq], k[r * gq:(r + 1) * gq], v[r * gq:(r + 1) * gq],
                                      heads // tp, groups // tp, d)
                assert torch.equal(shard, want)
            else:
                g = r // (tp // groups)
                group = ref[g * (heads // groups + 2) * d:(g + 1) * (heads // groups + 2) * d]
                part = r % (tp // groups)
                assert torch.equal(shard, group[part * rows:(part + 1) * rows])
        assert torch.equal(tp_gather(shards, TPSplit.ROWS), fused)


@pytest.mark.parametrize("fn", ["fuse", "split"])
def test_qkv_heads_not_a_multiple_of_groups_are_refused(fn):
    with pytest.raises(ValueError, match="^" + re.escape(
            "linear_qkv: num_heads=6 is not a multiple of num_query_groups=4") + "$"):
        if fn == "fuse":
            fuse_qkv(torch.zeros(6, 2), torch.zeros(4, 2), torch.zeros(4, 2), num_heads=6, num_query_groups=4,
                     head_dim=1)
        else:
            split_qkv(torch.zeros(14, 2), num_heads=6, num_query_groups=4, head_dim=1)
    with pytest.raises(ValueError, match="^" + re.escape("wq: num_heads=6 is not a multiple")):
        fuse_qkv(torch.zeros(6), torch.zeros(4), torch.zeros(4), num_heads=6, num_query_groups=4, head_dim=1,
                 name="wq")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_fuse_qkv_names_the_rows_that_do_not_match(which):
    heads, groups, d, hidden = 8, 4, 3, 5
    rows = {"q": heads * d, "k": groups * d, "v": groups * d}
    rows[which] -= 1
    q, k, v = (torch.zeros(rows[x], hidden) for x in "qkv")
    msg = f"linear_qkv: q/k/v rows {rows['q']}/{rows['k']}/{rows['v']} do not match heads=8, groups=4, head_dim=3"
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        fuse_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=d)
    with pytest.raises(ValueError, match="^" + re.escape("layer.7: q/k/v rows")):
        fuse_qkv(q[:, 0], k[:, 0], v[:, 0], num_heads=heads, num_query_groups=groups, head_dim=d, name="layer.7")


def test_split_qkv_names_the_expected_rows():
    with pytest.raises(ValueError, match="^" + re.escape(
            "linear_qkv has 47 rows, expected (H + 2G) * d = 48") + "$"):
        split_qkv(torch.zeros(47, 5), num_heads=8, num_query_groups=4, head_dim=3)
    with pytest.raises(ValueError, match="^" + re.escape("w has 13 rows, expected (H + 2G) * d = 12") + "$"):
        split_qkv(torch.zeros(13), num_heads=4, num_query_groups=1, head_dim=2, name="w")


# --- transforms: gated MLP ---------------------------------------------------------------------------
@pytest.mark.parametrize("ffn", [8, 2])
@pytest.mark.parametrize("rest", [(), (3,)])
def test_gate_up_is_gate_then_up_and_splits_back(ffn, rest):
    u = _Unique()
    gate, up = u(ffn, *rest), u(ffn, *rest)
    fc1 = fuse_gate_up(gate, up)
    assert fc1.shape == (2 * ffn, *rest)
    assert torch.equal(fc1, torch.stack([*gate, *up]))
    g, p = split_gate_up(fc1)
    assert torch.equal(g, gate) and torch.equal(p, up)
    # a transposed (non-contiguous) fc1 splits into contiguous halves
    g2, p2 = split_gate_up(fc1.T.contiguous().T) if rest else (g, p)
    assert g2.is_contiguous() and p2.is_contiguous() and torch.equal(g2, gate) and torch.equal(p2, up)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_tp_shard_of_rank_r_is_gate_r_then_up_r(tp):
    ffn, hidden = 8, 3
    u = _Unique()
    for rest in ((hidden,), ()):  # the weight and the bias
        gate, up = u(ffn, *rest), u(ffn, *rest)
        fc1 = fuse_gate_up(gate, up)
        f = ffn // tp
        shards = [tp_shard(fc1, TPSplit.GATED_ROWS, rank=r, size=tp) for r in range(tp)]
        for r, shard in enumerate(shards):
            assert torch.equal(shard, torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]]))
        assert torch.equal(tp_gather(shards, TPSplit.GATED_ROWS), fc1)


def test_gate_up_shape_errors():
    with pytest.raises(ValueError, match="^" + re.escape("gate (6, 4) and up (5, 4) differ") + "$"):
        fuse_gate_up(torch.zeros(6, 4), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="^" + re.escape("gate (6,) and up (6, 1) differ") + "$"):
        fuse_gate_up(torch.zeros(6), torch.zeros(6, 1))
    for rows in (5, 9):
        with pytest.raises(ValueError, match="^" + re.escape(f"linear_fc1 has an odd number of rows ({rows})") + "$"):
            split_gate_up(torch.zeros(rows, 4))
    with pytest.raises(ValueError, match=re.escape("odd number of rows (7)")):
        split_gate_up(torch.zeros(7))


# --- transforms: vocabulary padding ------------------------------------------------------------------
def test_pad_rows_appends_zero_rows():
    u = _Unique(torch.bfloat16)
    emb = u(5, 8)
    padded = pad_rows(emb, 8)
    assert padded.shape == (8, 8) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:5], emb) and torch.equal(padded[5:], torch.zeros(3, 8, dtype=torch.bfloat16))
    wide = u(5, 3)
    assert torch.equal(pad_rows(wide, 7), torch.cat([wide, torch.zeros(2, 3, dtype=torch.bfloat16)]))
    vec = u(3)
    assert torch.equal(pad_rows(vec, 4), torch.cat([vec, torch.zeros(1, dtype=torch.bfloat16)]))
    assert pad_rows(emb, 5) is emb  # nothing to pad: the tensor itself


def test_pad_rows_refuses_to_drop_rows():
    with pytest.raises(ValueError, match="^" + re.escape("cannot pad 5 rows down to 4") + "$"):
        pad_rows(torch.zeros(5, 8), 4)
    with pytest.raises(ValueError, match="^" + re.escape("cannot pad 5 rows down to 2") + "$"):
        pad_rows(torch.zeros(5, 3), 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocab_rows_shard_over_tp_and_export_unpadded(tp):
    """megatron pads the vocabulary to a multiple of 8 * TP here: the zero rows land on the last ranks."""
    cfg = _cfg("llama")
    dims = ModelDims.from_hf_config(cfg)
    emb = _Unique()(dims.vocab_size, dims.hidden_size)
    full_rows = 8 * tp * -(-dims.vocab_size // (8 * tp))
    full = pad_rows(rule_to_megatron(EMBEDDING, [emb], dims), full_rows)
    shards = [tp_shard(full, TPSplit.ROWS, rank=r, size=tp) for r in range(tp)]
    per = full_rows // tp
    for r, shard in enumerate(shards):
        want = torch.cat([emb, torch.zeros(full_rows - dims.vocab_size, dims.hidden_size, dtype=emb.dtype)])
        assert torch.equal(shard, want[r * per:(r + 1) * per])
    (back,) = rule_to_hf(EMBEDDING, tp_gather(shards, TPSplit.ROWS), dims)
    assert torch.equal(back, emb)


# --- transforms: TP splits ----------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cols_and_replicated_splits(tp):
    u = _Unique()
    proj = u(3, 8)
    c = 8 // tp
    shards = [tp_shard(proj, TPSplit.COLS, rank=r, size=tp) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, proj[:, r * c:(r + 1) * c])
    assert torch.equal(tp_gather(shards, TPSplit.COLS), proj)
    norm = u(6)
    reps = [tp_shard(norm, TPSplit.REPLICATED, rank=r, size=tp) for r in range(tp)]
    assert all(s is norm for s in reps)
    assert tp_gather(reps, TPSplit.REPLICATED) is norm


@pytest.mark.parametrize("split", list(TPSplit))
def test_one_tp_rank_holds_the_full_tensor_itself(split):
    t = _Unique()(8, 4)
    assert tp_shard(t, split, rank=0, size=1) is t
    assert tp_gather([t], split) is t


def test_rows_only_need_tp_to_divide_them():
    t = _Unique()(6, 4)
    assert torch.equal(tp_shard(t, TPSplit.ROWS, rank=1, size=2), t[3:])
    assert torch.equal(tp_shard(t.T, TPSplit.COLS, rank=1, size=2), t.T[:, 3:])
    fc1 = _Unique()(4, 3)  # gate 2 rows, up 2 rows: one of each per rank
    assert torch.equal(tp_shard(fc1, TPSplit.GATED_ROWS, rank=1, size=2), fc1[[1, 3]])


@pytest.mark.parametrize("shape,split,tp,msg", [
    ((6, 4), TPSplit.ROWS, 4, "dim 0 of size 6 does not split over TP=4 (rows)"),
    ((4, 6), TPSplit.COLS, 4, "dim 1 of size 6 does not split over TP=4 (cols)"),
    ((6, 4), TPSplit.GATED_ROWS, 2, "dim 0 of size 6 does not split over TP=2 (gated_rows)"),
    ((12,), TPSplit.GATED_ROWS, 4, "dim 0 of size 12 does not split over TP=4 (gated_rows)"),
])
def test_tp_shard_refuses_uneven_splits(shape, split, tp, msg):
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        tp_shard(torch.zeros(shape), split, rank=0, size=tp)


# --- the no-element-lost guard ------------------------------------------------------------------------
class _LossyTorch:
    """``torch`` with one op that drops the last row of what it returns (a fault to inject)."""

    def __init__(self, op):
        self.op = op

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name != self.op:
            return real
        if name == "cat":
            return lambda ts, dim=0: real(ts, dim=dim)[:-1]
        if name == "chunk":
            return lambda t, n, dim=0: tuple(c[:-1] for c in real(t, n, dim=dim))
        return lambda t, sizes, dim=0: tuple(s.narrow(dim, 0, s.shape[dim] - (i == 0))
                                             for i, s in enumerate(real(t, sizes, dim=dim)))


@pytest.mark.parametrize("op,call,msg", [
    ("cat", lambda: fuse_gate_up(torch.zeros(4, 3), torch.zeros(4, 3)), "fuse_gate_up: 24 elements in, 21 out"),
    ("chunk", lambda: split_gate_up(torch.zeros(8, 3)), "split_gate_up: 24 elements in, 18 out"),
    ("split", lambda: split_qkv(torch.zeros(6, 4), num_heads=2, num_query_groups=2, head_dim=1),
     "split_qkv: 24 elements in, 16 out"),
])
def test_transforms_assert_that_no_element_is_lost(monkeypatch, op, call, msg):
    monkeypatch.setattr(transforms_module, "torch", _LossyTorch(op))
    with pytest.raises(AssertionError, match="^" + re.escape(msg) + "$"):
        call()


# --- against the configs and models of transformers (slowest: last) ------------------------------
def test_family_of_real_hf_configs():
    from megatron_credit.conversion.testing import tiny_hf_config

    for family in ARCH:
        assert family_for_config(tiny_hf_config(family)) is FAMILIES.get(family)
        assert family_for_config(tiny_hf_config(family, architectures=None)) is FAMILIES.get(family)


def test_model_dims_of_a_real_qwen3_config_keep_its_decoupled_head_dim():
    from megatron_credit.conversion.testing import tiny_hf_config

    dims = ModelDims.from_hf_config(tiny_hf_config("qwen3", tie_word_embeddings=True))
    assert dims == ModelDims(num_layers=4, hidden_size=64, num_heads=4, num_query_groups=2, head_dim=32,
                             ffn_hidden_size=96, vocab_size=131, tie_word_embeddings=True)


def test_rule_names_match_the_models_transformers_builds():
    from megatron_credit.conversion.testing import hf_parameter_shapes, tiny_hf_config

    for family, kw in (("qwen2", {}), ("qwen3", {"tie_word_embeddings": True}),
                       ("llama", {"attention_bias": True, "mlp_bias": True}), ("llama", {})):
        cfg = tiny_hf_config(family, num_hidden_layers=2, **kw)
        shapes = hf_parameter_shapes(cfg)
        assert {h for _, hs, _ in expand_rules(FAMILIES.get(family), cfg) for h in hs} == set(shapes)
        dims = ModelDims.from_hf_config(cfg)
        mine = _hf_shapes(family, SimpleNamespace(**{**cfg.to_dict(), "head_dim": dims.head_dim}))
        assert mine == shapes, family
