"""Converter file handling: Transformer Engine ``_extra_state`` on either side of a dist checkpoint,
re-exporting into a folder that holds an earlier export, the exported config's dtype after a dtype
change on import, dtype checks over consumed tensors only, a tied config whose checkpoint still stores
``lm_head``, tokenizer files, and the checks on megatron-core's private save internals.

Saving a dist checkpoint starts a multiprocessing Manager (megatron's results queue), which daemonic
pool workers cannot do: every conversion runs in one subprocess (:func:`_produce`), which records the
outcome of each step in ``results.json``; the tests check those outcomes and the files on disk.
"""
from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO

VOCAB = 160


def _hf_model(family: str, *, dtype: torch.dtype, tied: bool = False):
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion.testing import tiny_hf_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_hf_config(family, vocab_size=VOCAB, tie_word_embeddings=tied),
                                            dtype=dtype)


def _add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """Rewrite ``folder/model.safetensors`` with ``extra`` tensors added (as old checkpoints stored them)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _extra_state_objects(num_layers: int) -> dict:
    """What TE's DotProductAttention adds to a layer's sharded state dict (one object per layer)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = "decoder.layers.self_attention.core_attention._extra_state"
    return {f"decoder.layers.{i}.self_attention.core_attention._extra_state":
            ShardedObject(key, io.BytesIO(b"fp8-meta"), (num_layers,), (i,), replica_id=0) for i in range(num_layers)}


def _with_extra_request(model, extra: dict) -> None:
    """Make ``model.sharded_state_dict()`` also request ``extra`` (a TE model's request, on a local model)."""
    original = model.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        out = original(*args, **kwargs)
        out.update(extra)
        return out

    model.sharded_state_dict = sharded_state_dict


def _step(results: dict, name: str, fn) -> None:
    try:
        results[name] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - recorded for the test that owns the step
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}


def _produce(root: str) -> None:
    """All conversions, run in a fresh process (see the module docstring)."""
    from megatron.core import dist_checkpointing

    from megatron_credit.conversion import converters as C, mcore_save, model_io
    from megatron_credit.commands import convert_hf_to_megatron as to_mc, convert_megatron_to_hf as to_hf

    root = Path(root)
    results: dict = {}
    # bf16 qwen2 with a stray fp32 rotary buffer (old checkpoints): its dtype must not count.
    src = root / "src_bf16"
    _hf_model("qwen2", dtype=torch.bfloat16).save_pretrained(src)
    _add_tensors(src, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(4)})
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    (src / "chat_template.jinja").write_text("{{ messages }}\n")
    _step(results, "import_bf16_default", lambda: C.convert_hf_to_megatron(src, root / "mc_bf16", progress=False))
    _step(results, "import_bf16_as_fp32",
          lambda: C.convert_hf_to_megatron(src, root / "mc_fp32", dtype="fp32", progress=False))
    for d in ("bf16", "fp32"):
        _step(results, f"export_{d}",
              lambda d=d: C.convert_megatron_to_hf(root / f"mc_{d}", root / f"back_{d}", progress=False))

    # Re-export into folders holding an earlier export, sharded -> single and single -> sharded.
    for name, sizes in (("sharded_then_single", ["20KB", "5GB"]), ("single_then_sharded", ["5GB", "20KB"])):
        out = root / name
        out.mkdir()
        (out / "README.md").write_text("keep me\n")
        ckpts = ["mc_fp32", "mc_bf16"]  # the second export writes different weights (bf16)
        _step(results, name, lambda out=out, sizes=sizes, ckpts=ckpts: [
            to_hf.main(["--ckpt", str(root / c), "--out", str(out), "--max-shard-size", s, "--no-progress"])
            for c, s in zip(ckpts, sizes, strict=True)])

    # A tied config whose checkpoint still stores lm_head (identical to the embedding).
    tied = root / "src_tied"
    model = _hf_model("llama", dtype=torch.float32, tied=True)
    model.save_pretrained(tied)
    _add_tensors(tied, {"lm_head.weight": model.model.embed_tokens.weight.detach().clone()})
    _step(results, "tied_with_lm_head", lambda: [
        to_mc.main(["--hf-dir", str(tied), "--out", str(root / "mc_tied"), "--no-progress"]),
        to_hf.main(["--ckpt", str(root / "mc_tied"), "--out", str(root / "back_tied"), "--no-progress"])])

    # An fp64 checkpoint without --dtype is refused before anything is written.
    f64 = root / "src_fp64"
    _hf_model("qwen2", dtype=torch.float64).save_pretrained(f64)
    _step(results, "fp64_without_dtype", lambda: C.convert_hf_to_megatron(f64, root / "mc_fp64", progress=False))
    results["fp64_out_exists"] = (root / "mc_fp64").exists()

    # Transformer Engine _extra_state: a TE-like request on our checkpoint, and a TE-written checkpoint.
    cfg = model_io.load_hf_config(root / "mc_fp32")
    layers = cfg.num_hidden_layers

    def te_request_loads():
        with model_io.single_stage_parallel_state():
            model = model_io.build_model(cfg, params_dtype=torch.float32)
            _with_extra_request(model, _extra_state_objects(layers))
            model_io.load_dist_checkpoint(model, root / "mc_fp32")
            ref = model_io.build_model(cfg, params_dtype=torch.float32)
            model_io.load_dist_checkpoint(ref, root / "mc_fp32")
            a, b = model.state_dict(), ref.state_dict()
            weights = [k for k in a if isinstance(a[k], torch.Tensor)]
            return len(weights) > 10 and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in weights)

    def weight_request_missing_raises():
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        with model_io.single_stage_parallel_state():
            model = model_io.build_model(cfg, params_dtype=torch.float32)
            _with_extra_request(model, {"bogus.weight": ShardedTensor.from_rank_offsets(
                "bogus.weight", torch.zeros(3), replica_id=0)})
            model_io.load_dist_checkpoint(model, root / "mc_fp32")

    def write_te_checkpoint():
        te = root / "mc_te"
        (te / model_io.MODEL_SUBDIR).mkdir(parents=True)
        for f in ("config.json", model_io.META_NAME):
            (te / f).write_bytes((root / "mc_fp32" / f).read_bytes())
        with model_io.single_stage_parallel_state():
            model = model_io.build_model(cfg, params_dtype=torch.float32)
            model_io.load_dist_checkpoint(model, root / "mc_fp32")
            request = mcore_save._whole_gated_fc1(model.sharded_state_dict())
            request.update(_extra_state_objects(layers))
            dist_checkpointing.save(request, str(te / model_io.MODEL_SUBDIR),
                                    sharded_strategy=mcore_save._save_strategy())
        return C.convert_megatron_to_hf(te, root / "back_te", progress=False)

    _step(results, "te_request_on_local_checkpoint", te_request_loads)
    _step(results, "missing_weight_key_raises", weight_request_missing_raises)
    _step(results, "te_checkpoint_to_hf", write_te_checkpoint)
    (root / "results.json").write_text(json.dumps(results, indent=1, default=str))


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    code = f"from tests.conversion.test_checkpoint_files import _produce; _produce({str(root)!r})"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, json.loads((root / "results.json").read_text())


def _ok(results: dict, name: str):
    r = results[name]
    assert r["ok"], r["trace"]
    return r["value"]


def _load_hf(folder: Path, dtype=None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype) if dtype else \
        AutoModelForCausalLM.from_pretrained(folder)


def _same_weights(a: Path, b: Path, dtype: torch.dtype | None = None) -> None:
    from megatron_credit.conversion.hf_io import SafetensorsReader

    x, y = SafetensorsReader(a), SafetensorsReader(b)
    names = [k for k in x.keys() if "rotary_emb" not in k and (k != "lm_head.weight" or k in y.keys())]
    assert sorted(names) == sorted(k for k in y.keys())
    for k in names:
        want = x.get(k) if dtype is None else x.get(k).to(dtype)
        assert torch.equal(y.get(k), want), k


# --- 1. Transformer Engine _extra_state -------------------------------------------------------------
@pytest.mark.spawn
def test_te_model_loads_local_spec_checkpoint(produced):
    """A model that also asks for TE's core_attention._extra_state gets the same weights."""
    assert _ok(produced[1], "te_request_on_local_checkpoint") is True


@pytest.mark.spawn
def test_te_written_checkpoint_converts_back(produced):
    root, results = produced
    _ok(results, "te_checkpoint_to_hf")
    _same_weights(root / "back_fp32", root / "back_te")


@pytest.mark.spawn
def test_missing_weight_key_still_raises(produced):
    r = produced[1]["missing_weight_key_raises"]
    assert not r["ok"] and "bogus.weight" in r["error"] and "_extra_state" in r["error"], r


# --- 2. re-exporting into a used folder -------------------------------------------------------------
@pytest.mark.parametrize("name", ["sharded_then_single", "single_then_sharded"])
@pytest.mark.spawn
def test_reexport_replaces_earlier_weight_files(produced, name):
    from megatron_credit.conversion.hf_io import INDEX_NAME, SINGLE_NAME, SafetensorsReader

    root, results = produced
    assert _ok(results, name) == [0, 0]
    out = root / name
    present = sorted(p.name for p in out.iterdir())
    assert "README.md" in present  # only weight files are removed
    if name == "sharded_then_single":
        assert [p for p in present if p.startswith("model")] == ["model.safetensors"]
    else:
        shards = [p for p in present if p.startswith("model-")]
        assert len(shards) > 1 and INDEX_NAME in present and SINGLE_NAME not in present
        index = json.loads((out / INDEX_NAME).read_text())
        assert sorted(set(index["weight_map"].values())) == shards
    _same_weights(root / "back_bf16", out)  # the second (bf16) export, by our reader
    model = _load_hf(out, dtype=torch.float32)  # and by transformers
    want = SafetensorsReader(root / "back_bf16")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want.get(k).float()), k


def test_reader_refuses_single_file_next_to_index(tmp_path):
    from megatron_credit.conversion.hf_io import SafetensorsReader, ShardedSafetensorsWriter

    t = {"a": torch.arange(6.0), "b": torch.ones(4)}
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=16)
    for k, v in t.items():
        w.add(k, v)
    assert len(w.close()) == 2
    from safetensors.torch import save_file

    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{tmp_path}.*both model.safetensors and model.safetensors.index.json"):
        SafetensorsReader(tmp_path)


def test_writer_removes_only_weight_files(tmp_path):
    """An unreadable index names no shards: shard-named files it might have listed stay (they may be the
    user's); the index itself goes, so that the folder is not ambiguous. See test_bad_input_checkpoints."""
    from megatron_credit.conversion.hf_io import ShardedSafetensorsWriter

    for name in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors",
                 "model.safetensors.index.json", "notes.txt", "adapter_model.safetensors", "config.json"):
        (tmp_path / name).write_text("old")
    w = ShardedSafetensorsWriter(tmp_path)
    w.add("x", torch.ones(3))
    assert w.close() == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_model.safetensors", "config.json",
                                                          "model-00001-of-00003.safetensors",
                                                          "model-00003-of-00003.safetensors",
                                                          "model.safetensors", "notes.txt"]


# --- 3. config dtype after a dtype change -----------------------------------------------------------
@pytest.mark.spawn
def test_export_config_names_the_written_dtype(produced):
    root, results = produced
    meta = _ok(results, "import_bf16_as_fp32")
    assert meta["dtype"] == "fp32" and meta["source_dtype"] == "bf16"
    _ok(results, "export_fp32")
    src_cfg = json.loads((root / "src_bf16" / "config.json").read_text())
    back_cfg = json.loads((root / "back_fp32" / "config.json").read_text())
    key = "dtype" if "dtype" in src_cfg else "torch_dtype"
    assert src_cfg[key] == "bfloat16" and back_cfg[key] == "float32"
    assert {k: v for k, v in back_cfg.items() if k != key} == {k: v for k, v in src_cfg.items() if k != key}
    assert _load_hf(root / "back_fp32").model.norm.weight.dtype == torch.float32  # transformers' default
    _same_weights(root / "src_bf16", root / "back_fp32", dtype=torch.float32)


@pytest.mark.spawn
def test_unchanged_dtype_keeps_config_bytes(produced):
    root, results = produced
    meta = _ok(results, "import_bf16_default")
    assert meta["dtype"] == "bf16" and meta["source_dtype"] == "bf16"  # the fp32 inv_freq does not count
    _ok(results, "export_bf16")
    assert (root / "back_bf16" / "config.json").read_bytes() == (root / "src_bf16" / "config.json").read_bytes()
    _same_weights(root / "src_bf16", root / "back_bf16")


def test_write_config_sets_torch_dtype_of_old_configs(tmp_path):
    from megatron_credit.conversion.converters import _write_config

    src = tmp_path / "src.json"
    src.write_text(json.dumps({"torch_dtype": "bfloat16", "hidden_size": 8}))
    _write_config(src, tmp_path / "a.json", torch.float32)
    assert json.loads((tmp_path / "a.json").read_text()) == {"torch_dtype": "float32", "hidden_size": 8}
    _write_config(src, tmp_path / "b.json", torch.bfloat16)
    assert (tmp_path / "b.json").read_bytes() == src.read_bytes()
    bare = tmp_path / "bare.json"
    bare.write_text('{"hidden_size": 8}')
    _write_config(bare, tmp_path / "c.json", torch.bfloat16, source_dtype=torch.bfloat16)
    assert (tmp_path / "c.json").read_bytes() == bare.read_bytes()  # unchanged dtype: untouched
    _write_config(bare, tmp_path / "d.json", torch.float32, source_dtype=torch.bfloat16)
    assert json.loads((tmp_path / "d.json").read_text()) == {"dtype": "float32", "hidden_size": 8}


# --- 5. minor ---------------------------------------------------------------------------------------
@pytest.mark.spawn
def test_fp64_source_needs_dtype_and_writes_nothing(produced):
    r = produced[1]["fp64_without_dtype"]
    assert not r["ok"] and "pass --dtype" in r["error"], r
    assert produced[1]["fp64_out_exists"] is False


@pytest.mark.spawn
def test_tied_config_with_stored_lm_head(produced):
    from megatron_credit.conversion.hf_io import SafetensorsReader

    root, results = produced
    assert _ok(results, "tied_with_lm_head") == [0, 0]
    back = SafetensorsReader(root / "back_tied")
    assert "lm_head.weight" not in back.keys()
    _same_weights(root / "src_tied", root / "back_tied")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _load_hf(root / "src_tied", torch.float32)(ids).logits
        got = _load_hf(root / "back_tied", torch.float32)(ids).logits
    assert torch.equal(got, want)


@pytest.mark.spawn
def test_tokenizer_files_are_copied(produced, tmp_path):
    from megatron_credit.conversion.hf_io import copy_tokenizer_files

    root, results = produced
    assert _ok(results, "import_bf16_default")["tokenizer_files"] == ["tokenizer_config.json", "chat_template.jinja",
                                                                     "generation_config.json"]
    for d in ("mc_bf16", "back_bf16"):
        assert (root / d / "chat_template.jinja").read_text() == "{{ messages }}\n"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "vocab.json").write_text("{}")
    (tmp_path / "src" / "merges.txt").write_text("#v\n")
    (tmp_path / "src" / "model.safetensors").write_text("not a tokenizer")
    assert copy_tokenizer_files(tmp_path / "src", tmp_path / "dst") == ["vocab.json", "merges.txt"]
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["merges.txt", "vocab.json"]
    assert (tmp_path / "dst" / "merges.txt").read_text() == "#v\n"


def test_qkv_shape_errors_name_the_tensor():
    from megatron_credit.conversion.base import ModelDims
    from megatron_credit.families import family_for_config
    from megatron_credit.conversion.streaming import iter_hf_from_megatron
    from megatron_credit.conversion.testing import tiny_hf_config

    cfg = tiny_hf_config("qwen2", vocab_size=VOCAB)
    family = family_for_config(cfg)
    dims = ModelDims.from_hf_config(cfg)

    def get(name):
        if name.endswith("linear_qkv.weight"):
            return torch.zeros(3, dims.hidden_size)
        return torch.zeros(VOCAB if "word_embeddings" in name else 1, dims.hidden_size)

    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.linear_qkv\.weight has 3 rows"):
        for _ in iter_hf_from_megatron(get, family, cfg):
            pass


def test_plan_refuses_a_name_on_two_stages():
    from megatron_credit.conversion import live

    # Two stages both claiming layer 0 (a wrong layer_offset) is an error, a tied head is not.
    state = {"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(2, 2), "output_layer.weight": torch.zeros(2, 2)}
    import torch.distributed as dist

    orig_ws, orig_ag = dist.get_world_size, dist.all_gather_object
    mine = {k: ((2, 2), torch.float32) for k in state}
    try:
        dist.get_world_size = lambda group=None: 2
        dist.all_gather_object = lambda out, obj, group=None: out.__setitem__(slice(None), [mine, mine])
        with pytest.raises(ValueError, match="both hold 'decoder.layers.0.mlp.linear_fc2.weight'"):
            live._plan(state, 0, pp_group=object())
        only_head = {"output_layer.weight": torch.zeros(2, 2)}
        mine = {"output_layer.weight": ((2, 2), torch.float32)}
        assert live._plan(only_head, 0, pp_group=object()) == {"output_layer.weight": (0, (2, 2), torch.float32)}
    finally:
        dist.get_world_size, dist.all_gather_object = orig_ws, orig_ag


# --- 4. megatron-core private save internals --------------------------------------------------------
class _Request:
    def __init__(self, async_fn, args=(0, [], None)):
        self.async_fn, self.async_fn_args, self.preload_fn, self.finalize_fns = async_fn, list(args), None, []


def write_preloaded_data_multiproc(transform_list, use_msc, rank, write_buckets, results):
    """Stands in for megatron 0.16's writer: the checks go by the function's name and arguments."""


def test_save_internals_are_checked():
    from megatron_credit.conversion.mcore_save import _checked_write_fn

    ok = functools.partial(write_preloaded_data_multiproc, [], False)
    assert _checked_write_fn(_Request(ok)) == ("write_preloaded_data_multiproc", ([], False), (0, [], None))
    assert _checked_write_fn(_Request(None)) is None
    bad = [(_Request(write_preloaded_data_multiproc), "expected functools.partial"),
           (_Request(functools.partial(print, [], False)), "wraps 'print'"),
           (_Request(functools.partial(write_preloaded_data_multiproc, [])), "bound to 1 positional"),
           (_Request(ok, args=(0, [])), "async_fn_args has 2 entries"),
           (object(), "has no 'async_fn'")]
    for request, match in bad:
        with pytest.raises(RuntimeError, match=f"unsupported megatron-core version .* for the in-process "
                                               f"checkpoint writer.*{match}"):
            _checked_write_fn(request)
