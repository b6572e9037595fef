"""Qwen3-MoE (``families/qwen3_moe.py``) on CPU: the HF <-> megatron round trip is bit for bit, under
``SequentialMLP``'s expert names and ``TEGroupedMLP``'s (TE's grouped GEMM, GPU only: built here as names,
its model in ``tests/models/test_gpt_gpu.py``), megatron's logits equal transformers' to 1e-5 with the same
experts chosen, the importer holds one rule's HF tensors at a time however many layers and experts there
are, and ``--ep`` is validated as ``--tp`` / ``--pp`` are.
"""
from __future__ import annotations

import re
import weakref

import pytest
import torch

from megatron_credit.conversion import ModelDims, check_hf_keys, family_for_config, iter_hf_from_megatron, \
    iter_megatron_from_hf
from megatron_credit.conversion.testing import hf_parameter_shapes, tiny_hf_config
from megatron_credit.families import FAMILIES


def _cfg(**kw):
    """2 layers, hidden 64, 4 experts of width 32, top-2 (the family's tiny config)."""
    return tiny_hf_config("qwen3_moe", **{"num_hidden_layers": 2, **kw})


def _hf_state(cfg, seed=0) -> dict[str, torch.Tensor]:
    """Unique-valued random tensors under the checkpoint's names (per expert)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_parameter_shapes(cfg).items()}


def test_the_family_is_registered_and_its_names_are_the_checkpoint_names():
    cfg = _cfg()
    fam = family_for_config(cfg)
    assert fam is FAMILIES.get("qwen3_moe") and fam.num_experts(cfg) == 4
    shapes = hf_parameter_shapes(cfg)
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 64)
    check_hf_keys(shapes, fam, cfg)  # every tensor has a rule and every rule a tensor


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_round_trip_is_bit_identical_and_experts_land_in_their_slots(norm_topk_prob):
    cfg = _cfg(norm_topk_prob=norm_topk_prob)
    fam, hf = family_for_config(cfg), _hf_state(cfg)
    mc = dict(iter_megatron_from_hf(hf.__getitem__, fam, cfg))
    assert sum(t.numel() for t in mc.values()) == sum(t.numel() for t in hf.values())
    p = "decoder.layers.1.mlp."
    assert torch.equal(mc[p + "router.weight"], hf["model.layers.1.mlp.gate.weight"])
    fc1 = mc[p + "experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.experts.2.gate_proj.weight"],
                                       hf["model.layers.1.mlp.experts.2.up_proj.weight"]]))
    assert torch.equal(mc[p + "experts.local_experts.2.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.2.down_proj.weight"])
    back = dict(iter_hf_from_megatron(mc.__getitem__, fam, cfg))
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


def _as_grouped(name: str) -> str:
    """``SequentialMLP``'s name of an expert's linear -> ``TEGroupedMLP``'s (written here, not by the library)."""
    return re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"experts.\2.weight\1", name)


def test_grouped_expert_names_round_trip_bit_identical_and_hold_the_sequential_tensors():
    """TE's grouped experts: ``mlp.experts.linear_fc1.weight{e}`` is ``local_experts.{e}.linear_fc1.weight``
    ([gate; up] of expert ``e``); every other name is the same; HF -> grouped -> HF gives the input back."""
    from megatron_credit.conversion.live import expert_of, uses_grouped_experts, with_expert

    cfg = _cfg()
    fam, hf = family_for_config(cfg), _hf_state(cfg)
    seq = dict(iter_megatron_from_hf(hf.__getitem__, fam, cfg))
    grouped = dict(iter_megatron_from_hf(hf.__getitem__, fam, cfg, grouped_experts=True))
    assert list(grouped) == [_as_grouped(k) for k in seq]  # same order, only the experts renamed
    assert sum(k != _as_grouped(k) for k in seq) == 2 * 2 * 4  # fc1 and fc2 of 4 experts in 2 layers
    for k, t in seq.items():
        assert torch.equal(grouped[_as_grouped(k)], t), k
    assert torch.equal(grouped["decoder.layers.1.mlp.experts.linear_fc1.weight3"],
                       torch.cat([hf["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                  hf["model.layers.1.mlp.experts.3.up_proj.weight"]]))
    back = dict(iter_hf_from_megatron(grouped.__getitem__, fam, cfg, grouped_experts=True))
    assert list(back) == list(dict(iter_hf_from_megatron(seq.__getitem__, fam, cfg)))
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k
    # the live helpers read an expert's index in either naming and keep the naming when renumbering
    assert uses_grouped_experts(grouped) and not uses_grouped_experts(seq)
    g, s = "decoder.layers.1.mlp.experts.linear_fc2.weight3", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert (expert_of(g), expert_of(s), expert_of("decoder.layers.1.mlp.experts.linear_fc2._extra_state")) == (3, 3, None)
    assert (with_expert(g, 12), with_expert(s, 12)) == (g[:-1] + "12", s.replace(".3.", ".12."))


def _peak_live_hf_tensors(cfg) -> tuple[int, int]:
    """(peak HF tensors alive at once, tensors read) while the importer's output is consumed one by one."""
    shapes = hf_parameter_shapes(cfg)
    live: list[weakref.ref] = []
    peak = reads = 0

    def get(name: str) -> torch.Tensor:
        nonlocal peak, reads
        t = torch.zeros(shapes[name])
        live.append(weakref.ref(t))  # dies with the tensor's last reference (reference counting)
        peak, reads = max(peak, sum(r() is not None for r in live)), reads + 1
        return t

    for _, tensor in iter_megatron_from_hf(get, family_for_config(cfg), cfg):
        del tensor  # a converter copies it into the model and lets go
    return peak, reads


def test_importer_holds_one_rules_tensors_whatever_the_layers_and_experts():
    """The bound is that of one rule (q, k, v of one layer: 3 tensors; one expert's gate and up: 2),
    the same for 1 layer of 2 experts as for 4 layers of 8: never all experts of a layer, or of all layers."""
    small = _peak_live_hf_tensors(_cfg(num_hidden_layers=1, num_experts=2))
    large = _peak_live_hf_tensors(_cfg(num_hidden_layers=4, num_experts=8))
    assert small[0] == large[0] == 3
    # every tensor read once: embedding, final norm, head; 9 attention / norm / router tensors and 3 per expert a layer
    assert (small[1], large[1]) == (3 + 1 * (9 + 3 * 2), 3 + 4 * (9 + 3 * 8))


def test_refusals_name_the_field_in_one_line():
    for kw, msg in [
        (dict(decoder_sparse_step=2), "hf_config.decoder_sparse_step=2 is not supported: every layer must be a "
                                      "mixture of experts (decoder_sparse_step=1)"),
        (dict(mlp_only_layers=[0]), "hf_config.mlp_only_layers=[0] is not supported: every layer must be a "
                                    "mixture of experts (mlp_only_layers=[])"),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
            family_for_config(_cfg(**kw))


@pytest.mark.parametrize("tp,pp,ep,msg", [
    (1, 1, 3, "ep=3 does not divide num_experts=4"),
    (1, 1, 0, "ep must be >= 1, got ep=0"),
    (2, 1, 1, None),
    (1, 1, 4, None),
])
def test_expert_parallel_size_is_checked_against_the_experts(tp, pp, ep, msg):
    dims = ModelDims.from_hf_config(_cfg(vocab_size=160))  # vocabulary rows split over TP = 2
    assert (dims.num_experts, dims.expert_ffn_hidden_size) == (4, 32)
    if msg is None:
        dims.check_parallel(tp=tp, pp=pp, ep=ep)
    else:
        with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
            dims.check_parallel(tp=tp, pp=pp, ep=ep)


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match=r"^ep=2 needs routed experts: the model has none$"):
        ModelDims.from_hf_config(tiny_hf_config("qwen3")).check_parallel(tp=1, pp=1, ep=2)


def test_converter_validates_ep_in_one_line_before_writing(tmp_path, capsys):
    from tools import convert_hf_to_megatron

    src, out = tmp_path / "moe", tmp_path / "out"
    src.mkdir()
    _cfg().to_json_file(str(src / "config.json"))
    assert convert_hf_to_megatron.main(["--hf-dir", str(src), "--out", str(out), "--ep", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: ep=3 does not divide num_experts=4"]
    assert not out.exists()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_logits_equal_transformers(tmp_path, norm_topk_prob):
    """fp32, one process: the HF model's weights through the importer into megatron's GPTModel (local
    spec, SequentialMLP); logits agree to 1e-5 and the tokens take more than one route."""
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion import load_hf_into_local_state
    from megatron_credit.conversion.model_io import build_model, single_stage_parallel_state

    cfg = _cfg(norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # a router that is not near uniform, so the top-k and its weights matter
        for layer in hf_model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    hf_model.save_pretrained(tmp_path)
    from megatron_credit.conversion.hf_io import SafetensorsReader

    reader = SafetensorsReader(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12)
    routes = []
    hook = hf_model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: routes.append(out[2]))
    with torch.no_grad():
        want = hf_model(input_ids=ids, position_ids=pos).logits
    hook.remove()
    routes = {tuple(r) for r in routes[0].sort(-1).values.tolist()}  # the expert pairs layer 0 chose
    assert len(routes) > 1
    with single_stage_parallel_state():
        model = build_model(cfg, params_dtype=torch.float32).eval()
        load_hf_into_local_state(model.state_dict(keep_vars=True), reader.get, family_for_config(cfg), cfg,
                                 tp_rank=0, tp_size=1, layer_offset=0)
        assert model.config.moe_router_pre_softmax is (not norm_topk_prob)
        with torch.no_grad():
            got = model(input_ids=ids, position_ids=pos, attention_mask=None)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 1e-5, err


def test_round_trip_through_the_tools_and_a_dist_checkpoint_is_bit_identical(tmp_path):
    """HF -> ``convert_hf_to_megatron --ep 2`` (every expert written whole) -> ``convert_megatron_to_hf``."""
    from transformers import AutoModelForCausalLM

    from megatron_credit.commands import convert_hf_to_megatron as to_mc, convert_megatron_to_hf as to_hf
    from megatron_credit.conversion.hf_io import SafetensorsReader

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_cfg(norm_topk_prob=True), dtype=torch.float32).save_pretrained(tmp_path / "src")
    assert to_mc.main(["--hf-dir", str(tmp_path / "src"), "--out", str(tmp_path / "mc"), "--ep", "2",
                       "--no-progress"]) == 0
    assert to_hf.main(["--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    a, b = SafetensorsReader(tmp_path / "src"), SafetensorsReader(tmp_path / "back")
    assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) == 3 + 2 * (9 + 3 * 4)
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k
