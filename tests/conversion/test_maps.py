"""CPU tests of the conversion maps: transforms against loop references, HF round trips, I/O, errors."""
import json

import pytest
import torch

from megatron_credit.conversion import (FAMILIES, ModelDims, check_hf_keys, family_for_config,
                                        iter_hf_from_megatron, iter_megatron_from_hf)
from megatron_credit.conversion.hf_io import SafetensorsReader, ShardedSafetensorsWriter, resolve_dtype
from megatron_credit.conversion.testing import checkpoint_state, tiny_hf_config, write_random_hf_checkpoint
from megatron_credit.conversion.transforms import (TPSplit, fuse_gate_up, fuse_qkv, split_gate_up, split_qkv,
                                                   tp_gather, tp_shard)
from megatron_credit.families import supported_model_types
from tests.references import qkv_reference

FAMILY_NAMES = list(supported_model_types())  # every registered family


@pytest.mark.parametrize("heads,groups,d,bias", [(8, 2, 3, False), (4, 4, 2, True), (6, 1, 4, False)])
def test_fuse_qkv_matches_loop_and_inverts(heads, groups, d, bias):
    g = torch.Generator().manual_seed(0)
    shape = () if bias else (5,)
    q = torch.randn(heads * d, *shape, generator=g, dtype=torch.float64)
    k = torch.randn(groups * d, *shape, generator=g, dtype=torch.float64)
    v = torch.randn(groups * d, *shape, generator=g, dtype=torch.float64)
    fused = fuse_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=d)
    assert torch.equal(fused, qkv_reference(q, k, v, heads, groups, d))
    for a, b in zip(split_qkv(fused, num_heads=heads, num_query_groups=groups, head_dim=d), (q, k, v)):
        assert torch.equal(a, b)


def test_fuse_qkv_rejects_wrong_rows():
    with pytest.raises(ValueError, match="do not match"):
        fuse_qkv(torch.zeros(8, 2), torch.zeros(3, 2), torch.zeros(4, 2), num_heads=4, num_query_groups=2,
                 head_dim=2)
    with pytest.raises(ValueError, match="expected"):
        split_qkv(torch.zeros(7, 2), num_heads=4, num_query_groups=2, head_dim=1)


def test_gate_up_round_trip():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)
    a, b = split_gate_up(fc1)
    assert torch.equal(a, gate) and torch.equal(b, up)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_match_megatron_splits(tp):
    """Rank r of fc1 holds [gate_r; up_r]; rank r of linear_qkv holds whole query groups."""
    heads, groups, d, ffn = 8, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(ffn, 3, generator=g), torch.randn(ffn, 3, generator=g)
    fc1 = fuse_gate_up(gate, up)
    q, k, v = (torch.randn(n * d, 3, generator=g) for n in (heads, groups, groups))
    qkv = fuse_qkv(q, k, v, num_heads=heads, num_query_groups=groups, head_dim=d)
    proj = torch.randn(3, heads * d, generator=g)
    f, hq, gq = ffn // tp, heads // tp, groups // tp
    for r in range(tp):
        shard = tp_shard(fc1, TPSplit.GATED_ROWS, rank=r, size=tp)
        assert torch.equal(shard, torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]]))
        want = fuse_qkv(q[r * hq * d:(r + 1) * hq * d], k[r * gq * d:(r + 1) * gq * d],
                        v[r * gq * d:(r + 1) * gq * d], num_heads=hq, num_query_groups=gq, head_dim=d)
        assert torch.equal(tp_shard(qkv, TPSplit.ROWS, rank=r, size=tp), want)
        assert torch.equal(tp_shard(proj, TPSplit.COLS, rank=r, size=tp), proj[:, r * hq * d:(r + 1) * hq * d])
    for t, split in ((fc1, TPSplit.GATED_ROWS), (qkv, TPSplit.ROWS), (proj, TPSplit.COLS),
                     (gate, TPSplit.REPLICATED)):
        assert torch.equal(tp_gather([tp_shard(t, split, rank=r, size=tp) for r in range(tp)], split), t)


def _hf_state(cfg, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    return {k: v.detach().clone() for k, v in checkpoint_state(model.state_dict()).items()}


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("fused_norms", [False, True])
def test_hf_megatron_hf_round_trip_is_bit_identical(family, fused_norms):
    cfg = tiny_hf_config(family, tie_word_embeddings=(family == "llama"))
    fam = family_for_config(cfg)
    assert fam is FAMILIES.get(family)
    hf = _hf_state(cfg)
    hf.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    check_hf_keys(hf, fam, cfg)
    mc = dict(iter_megatron_from_hf(hf.__getitem__, fam, cfg, fused_norms=fused_norms))
    assert sum(t.numel() for t in mc.values()) == sum(t.numel() for t in hf.values())
    dims = ModelDims.from_hf_config(cfg)
    assert mc["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (
        (dims.num_heads + 2 * dims.num_query_groups) * dims.head_dim, dims.hidden_size)
    norm_name = ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" if fused_norms
                 else "decoder.layers.0.input_layernorm.weight")
    assert torch.equal(mc[norm_name], hf["model.layers.0.input_layernorm.weight"])
    back = dict(iter_hf_from_megatron(mc.__getitem__, fam, cfg, fused_norms=fused_norms))
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


def test_family_specific_tensors_are_mapped():
    q2 = dict(iter_megatron_from_hf(_hf_state(tiny_hf_config("qwen2")).__getitem__, FAMILIES.get("qwen2"),
                                    tiny_hf_config("qwen2")))
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in q2
    cfg3 = tiny_hf_config("qwen3")
    q3 = dict(iter_megatron_from_hf(_hf_state(cfg3).__getitem__, FAMILIES.get("qwen3"), cfg3))
    assert q3["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (32,)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in q3
    cfgl = tiny_hf_config("llama", attention_bias=True, mlp_bias=True)
    ll = dict(iter_megatron_from_hf(_hf_state(cfgl).__getitem__, FAMILIES.get("llama"), cfgl))
    assert {"decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.mlp.linear_fc1.bias",
            "decoder.layers.0.mlp.linear_fc2.bias"} <= set(ll)


def test_unknown_architecture_lists_supported():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*"
                                         r"LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        family_for_config(cfg)


def test_missing_and_unmapped_tensors_are_refused():
    cfg = tiny_hf_config("qwen2")
    fam = FAMILIES.get("qwen2")
    hf = _hf_state(cfg)
    with pytest.raises(ValueError, match="missing.*model.layers.1.self_attn.k_proj.bias"):
        check_hf_keys({k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.bias"}, fam, cfg)
    with pytest.raises(ValueError, match="no rule.*model.layers.0.mlp.extra.weight"):
        check_hf_keys({**hf, "model.layers.0.mlp.extra.weight": torch.zeros(1)}, fam, cfg)
    check_hf_keys({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}, fam, cfg)


@pytest.mark.parametrize("tp,pp,match", [(5, 1, "num_attention_heads"), (3, 1, "query groups"),
                                         (1, 3, "num_hidden_layers"), (0, 1, ">= 1")])
def test_parallel_sizes_are_checked(tp, pp, match):
    dims = ModelDims.from_hf_config(tiny_hf_config("qwen2", num_attention_heads=12, num_key_value_heads=2,
                                                   hidden_size=96, intermediate_size=96))
    with pytest.raises(ValueError, match=match):
        dims.check_parallel(tp=tp, pp=pp)
    ModelDims.from_hf_config(tiny_hf_config("qwen2", vocab_size=160)).check_parallel(tp=2, pp=4)
    # TP a multiple of the KV heads (2 groups at TP = 4), as megatron-core allows.
    ModelDims.from_hf_config(tiny_hf_config("qwen2", vocab_size=160)).check_parallel(tp=4, pp=1)
    with pytest.raises(ValueError, match="vocab_size=131"):
        ModelDims.from_hf_config(tiny_hf_config("qwen2")).check_parallel(tp=2, pp=1)


def test_sharded_writer_and_reader_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, generator=g).to(torch.bfloat16) for i in range(7)}
    writer = ShardedSafetensorsWriter(tmp_path / "a", max_shard_bytes=450)
    for k, v in tensors.items():
        writer.add(k, v)
    files = writer.close()
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert set(index["weight_map"].values()) == set(files)
    reader = SafetensorsReader(tmp_path / "a")
    assert sorted(reader.keys()) == sorted(tensors) and reader.dtypes() == {torch.bfloat16}
    for k, v in tensors.items():
        assert torch.equal(reader.get(k), v)
    one = ShardedSafetensorsWriter(tmp_path / "b")
    one.add("x", tensors["t0"])
    assert one.close() == ["model.safetensors"]
    assert torch.equal(SafetensorsReader(tmp_path / "b").get("x"), tensors["t0"])
    with pytest.raises(ValueError, match="written twice"):
        w = ShardedSafetensorsWriter(tmp_path / "c")
        w.add("x", tensors["t0"])
        w.add("x", tensors["t0"])


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SafetensorsReader(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        SafetensorsReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard 'x.safetensors'"):
        SafetensorsReader(tmp_path)


def test_dtype_resolution():
    assert resolve_dtype({torch.bfloat16}, None, allow_lossy=False) == torch.bfloat16
    assert resolve_dtype({torch.float16, torch.bfloat16}, "fp32", allow_lossy=False) == torch.float32
    for src, req in ((torch.bfloat16, "fp16"), (torch.float16, "bf16"), (torch.float32, "bf16")):
        with pytest.raises(ValueError, match="loses precision"):
            resolve_dtype({src}, req, allow_lossy=False)
        assert resolve_dtype({src}, req, allow_lossy=True) == {"fp16": torch.float16, "bf16": torch.bfloat16}[req]
    with pytest.raises(ValueError, match="mixes dtypes"):
        resolve_dtype({torch.float16, torch.bfloat16}, None, allow_lossy=False)


def test_random_checkpoint_writer_matches_hf_format(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config("qwen3")
    nbytes = write_random_hf_checkpoint(cfg, tmp_path, dtype=torch.bfloat16, max_shard_bytes=100_000)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    reader = SafetensorsReader(tmp_path)
    assert nbytes == sum(p.numel() * 2 for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, reader.get(k)), k


def test_streaming_safetensors_writer_matches_the_library(tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_credit.conversion.hf_io import write_safetensors

    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(3, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
               "c": torch.randn(2, 2, generator=g).to(torch.float16), "e": torch.zeros(0, 4),
               "t": torch.randn(4, 6, generator=g).t()}  # non-contiguous
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "lib.safetensors"))
    ours, lib = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "lib.safetensors"))
    assert set(ours) == set(tensors)
    for k in tensors:
        assert ours[k].dtype == lib[k].dtype and torch.equal(ours[k], lib[k]), k
