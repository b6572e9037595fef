"""Converted megatron models give the logits of ``transformers`` (fp32, left-padded batch) at TP=1,
TP=2 and PP=2 on gloo, tied word embeddings included (Llama 3.2 / Qwen3 style), from HF weights
loaded in memory and from the dist checkpoint written by the converter (resharded on load); the
HF -> megatron -> HF round trip through the command-line tools is bit-identical; a wrong QKV row order
and a wrong RoPE base are caught by the same parity check.

Each family also runs with q/k scaled so that attention is peaked: with random-init weights the
attention is near-uniform and a RoPE or head-order mistake barely moves the logits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.parity import FAMILIES, TOL, TIED, _make_hf_dir, _batch, _hf_logits, _rel_err, _megatron_logits, _last
from tests.support.paths import REPO

pytestmark = pytest.mark.dist


# --- fixtures --------------------------------------------------------------------------------------
pool = module_pool(2)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {(f, s): _make_hf_dir(root, f, s) for f in FAMILIES for s in (False, True)}
    dirs.update({(f, True): _make_hf_dir(root, f, True) for f in TIED})
    return dirs


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    """HF -> megatron -> HF through the two command-line tools, one subprocess for all families."""
    root = tmp_path_factory.mktemp("converted")
    script = ["import sys", "from megatron_credit.commands import convert_hf_to_megatron as a, convert_megatron_to_hf as b"]
    sources = {**{f: hf_dirs[(f, False)] for f in FAMILIES}, "qwen3-tied": hf_dirs[("qwen3-tied", True)]}
    for f, src in sources.items():
        ck, back = root / f"{f}_mc", root / f"{f}_hf"
        script += [f"assert a.main(['--hf-dir', '{src}', '--out', '{ck}', '--tp', '2', '--pp', '2']) == 0",
                   f"assert b.main(['--ckpt', '{ck}', '--out', '{back}', '--max-shard-size', '20KB']) == 0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", "\n".join(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {f: (root / f"{f}_mc", root / f"{f}_hf") for f in sources}


# --- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_attention_is_peaked(hf_dirs, family):
    """The scaled run is a real RoPE test: most queries put over half their mass on one key."""
    out = _hf_logits(hf_dirs[(family, True)], attentions=True)
    att = out.attentions[-1][0]  # [heads, S, S] of the longest (unpadded) sequence
    peak = att[:, 4:].max(dim=-1).values.mean().item()  # queries with >= 5 visible keys
    assert peak > 0.5, peak
    plain = _hf_logits(hf_dirs[(family, False)], attentions=True).attentions[-1][0]
    assert plain[:, 4:].max(dim=-1).values.mean().item() < 0.35  # random init: near-uniform


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_tp1_tp2_pp2(pool, hf_dirs, family):
    for scaled in (False, True):
        hf_dir = hf_dirs[(family, scaled)]
        want = _hf_logits(hf_dir).logits
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            got = _last(pool.run(_megatron_logits, str(hf_dir), tp, pp))
            assert got.shape == want.shape
            err = _rel_err(got, want)
            assert err < TOL, (family, scaled, tp, pp, err)


@pytest.mark.parametrize("family", TIED)
def test_tied_embeddings_logits_at_tp1_tp2_pp2(pool, hf_dirs, family):
    """At PP=2 the last stage holds its own copy of the tied head (megatron's embedding group; CPU
    shim 4 in megatron_credit/distributed/cpu_shims.py), filled from the HF embedding."""
    hf_dir = hf_dirs[(family, True)]
    want = _hf_logits(hf_dir).logits
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        err = _rel_err(_last(pool.run(_megatron_logits, str(hf_dir), tp, pp)), want)
        assert err < TOL, (family, tp, pp, err)


def test_tied_dist_checkpoint_from_pp2_loads_at_any_layout(pool, hf_dirs, converted):
    """A tied model converted by the tool with ``--pp 2`` (a layout-free checkpoint holding one
    ``embedding.word_embeddings.weight`` and no output layer) loads at PP=2, where the last stage's
    head copy must come from that embedding, at TP=2 and TP=1, and round-trips to HF without
    ``lm_head.weight``, bit for bit."""
    from megatron_credit.conversion.hf_io import SafetensorsReader

    hf_dir = hf_dirs[("qwen3-tied", True)]
    ckpt, back = converted["qwen3-tied"]
    want = _hf_logits(hf_dir).logits
    for tp, pp in ((1, 2), (2, 1), (1, 1)):
        err = _rel_err(_last(pool.run(_megatron_logits, str(hf_dir), tp, pp, ckpt_dir=str(ckpt))), want)
        assert err < TOL, (tp, pp, err)
    a, b = SafetensorsReader(hf_dir), SafetensorsReader(back)
    assert "lm_head.weight" not in a.keys() and sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k


@pytest.mark.parametrize("family", FAMILIES)
def test_dist_checkpoint_loads_at_any_layout(pool, hf_dirs, converted, family):
    hf_dir = hf_dirs[(family, False)]
    want = _hf_logits(hf_dir).logits
    ckpt = converted[family][0]
    meta = json.loads((ckpt / "conversion_meta.json").read_text())
    assert meta["family"] == family and meta["dtype"] == "fp32" and meta["format"] == "torch_dist"
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        got = _last(pool.run(_megatron_logits, str(hf_dir), tp, pp, ckpt_dir=str(ckpt)))
        assert _rel_err(got, want) < TOL, (family, tp, pp)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_tools_is_bit_identical(hf_dirs, converted, family):
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion.hf_io import SafetensorsReader

    src, back = hf_dirs[(family, False)], converted[family][1]
    a, b = SafetensorsReader(src), SafetensorsReader(back)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert (src / "config.json").read_bytes() == (back / "config.json").read_bytes()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded by size
    model = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32, attn_implementation="eager")
    ids, mask, pos = _batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(got, _hf_logits(src).logits)


@pytest.mark.parametrize("corrupt", ["qkv", "rope"])
def test_parity_check_catches_wrong_conversions(pool, hf_dirs, corrupt):
    hf_dir = hf_dirs[("qwen2", True)]
    want = _hf_logits(hf_dir).logits
    for tp in (1, 2):
        got = _last(pool.run(_megatron_logits, str(hf_dir), tp, 1, corrupt=corrupt))
        assert _rel_err(got, want) > 100 * TOL, (corrupt, tp)


def test_converter_errors(hf_dirs, tmp_path):
    from megatron_credit.conversion.converters import convert_hf_to_megatron, convert_megatron_to_hf

    src = hf_dirs[("qwen2", False)]
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        convert_hf_to_megatron(src, tmp_path / "a", tp=3)
    with pytest.raises(ValueError, match="pp=3 does not divide num_hidden_layers=4"):
        convert_hf_to_megatron(src, tmp_path / "a", pp=3)
    with pytest.raises(ValueError, match="loses precision"):
        convert_hf_to_megatron(src, tmp_path / "a", dtype="bf16")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_hf_to_megatron(tmp_path, tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="conversion_meta.json"):
        convert_megatron_to_hf(src, tmp_path / "b")
