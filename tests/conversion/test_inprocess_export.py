"""megatron -> HF export, the checks on a converted checkpoint and the in-process dist-checkpoint writer,
run in the pytest process (so that ``make mutation`` sees them; the subprocess tests in
``tests/conversion/test_checkpoint_files.py`` / ``tests/conversion/test_checkpoint_bad_input.py`` check the
same surfaces from outside).

- the export is bit-exact against the source safetensors, sharded by ``max_shard_bytes`` with an index
  naming the shard of every tensor, with the tokenizer files and ``config.json``: copied byte for byte
  when its dtype field names the exported dtype, rewritten (that field only) otherwise;
- ``conversion_meta.json`` is checked (missing, not JSON, not an object, a key missing, another
  converter version, an unknown dtype, a dtype the stored weights do not have) before anything is read;
- loading is strict for weights: only Transformer Engine ``_extra_state`` may be absent on one side;
- ``safe_load``: ``.metadata`` is unpickled with an allow-list (a crafted pickle is refused before it
  runs), the files it names must hold its bytes, byte items must load with ``weights_only=True``;
- the save strategy writes ``torch_dist`` in this process, refusing megatron internals it does not know.

Saving a dist checkpoint starts megatron's spawn ``Manager`` once per process (~3 s): the checkpoints are
made once, in module-scoped fixtures; each test that changes one works on a copy.
"""
from __future__ import annotations

import functools
import io
import json
import os
import pickle
import queue
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from megatron_credit.conversion import converters as C, mcore_save, model_io
from megatron_credit.conversion.export_target import MANIFEST_NAME
from megatron_credit.conversion.hf_io import INDEX_NAME, CheckpointFormatError, SafetensorsReader
from megatron_credit.conversion.safe_load import (COMMON_STATE_KEY, UnsafeCheckpointError, check_dist_checkpoint,
                                                  megatron_reads_common_state, read_dist_metadata, stored_weight_dtypes)
from megatron_credit.conversion.testing import rewrite_common_state
from tests.support.payloads import RunsCode

SHARD_BYTES = 20_000  # the tiny model's bf16 weights are ~150 KB: several shards
TOKENIZER = {"tokenizer_config.json": '{"model_max_length": 64}\n', "chat_template.jinja": "{{ messages }}\n"}
UNSUPPORTED = (r"unsupported megatron-core version (?P<v>\S+) for the in-process checkpoint writer "
               r"\(megatron_credit/conversion/mcore_save\.py; checked on 0\.16\.1 - 0\.19\.2\): ")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A bf16 HF source, its bf16 and fp32 dist checkpoints, and the bf16 one exported back (sharded)."""
    from megatron_credit.conversion.testing import tiny_hf_config, write_random_hf_checkpoint

    root = tmp_path_factory.mktemp("export")
    src = root / "src"
    write_random_hf_checkpoint(tiny_hf_config("qwen2", num_hidden_layers=2, vocab_size=96), src,
                               dtype=torch.bfloat16, seed=7)
    for name, text in TOKENIZER.items():
        (src / name).write_text(text)
    meta16 = C.convert_hf_to_megatron(src, root / "mc_bf16", progress=False)
    meta32 = C.convert_hf_to_megatron(src, root / "mc_fp32", dtype="fp32", progress=False)
    back = root / "exports" / "back"  # a parent that does not exist yet
    files = C.convert_megatron_to_hf(root / "mc_bf16", back, max_shard_bytes=SHARD_BYTES, progress=False)
    return SimpleNamespace(root=root, src=src, bf16=root / "mc_bf16", fp32=root / "mc_fp32", back=back,
                           files=files, meta16=meta16, meta32=meta32)


def _copy(ckpt: Path, dst: Path) -> Path:
    shutil.copytree(ckpt, dst)
    return dst


def _source_tensors(made) -> dict[str, torch.Tensor]:
    reader = SafetensorsReader(made.src)
    return {k: reader.get(k) for k in reader.keys()}


def _assert_weights(folder: Path, want: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    reader = SafetensorsReader(folder)
    assert sorted(reader.keys()) == sorted(want)
    for k, v in want.items():
        got = reader.get(k)
        assert got.dtype == dtype and torch.equal(got, v.to(dtype)), k


def _edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


# --- the export ----------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_sharded_and_indexed(made):
    want = _source_tensors(made)
    assert len({t.float().sum().item() for t in want.values()}) == len(want)  # every tensor distinct
    _assert_weights(made.back, want, torch.bfloat16)
    n = len(made.files)
    assert n > 2 and made.files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((made.back / INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": sum(t.numel() * 2 for t in want.values())}
    assert sorted(index["weight_map"]) == sorted(want)
    for shard in made.files:
        with safe_open(str(made.back / shard), "pt") as f:
            names = sorted(f.keys())
        assert names == sorted(k for k, f in index["weight_map"].items() if f == shard), shard
        nbytes = sum(want[k].numel() * 2 for k in names)
        assert nbytes <= SHARD_BYTES or len(names) == 1, (shard, nbytes)
    assert sorted(p.name for p in made.back.iterdir()) == sorted([*made.files, INDEX_NAME, "config.json", *TOKENIZER,
                                                                   MANIFEST_NAME])  # what it wrote (export_target)
    assert json.loads((made.back / MANIFEST_NAME).read_text())["files"] == sorted(
        [*made.files, INDEX_NAME, "config.json", *TOKENIZER])
    assert (made.back / "config.json").read_bytes() == (made.src / "config.json").read_bytes()  # dtype unchanged
    for name, text in TOKENIZER.items():
        assert (made.back / name).read_text() == text


def test_export_in_another_dtype_rewrites_the_config_dtype(made, tmp_path):
    """bf16 weights exported as fp32: every tensor is the exact fp32 value, config.json says float32."""
    assert C.convert_megatron_to_hf(made.bf16, tmp_path / "out", dtype="fp32", progress=False) == ["model.safetensors"]
    _assert_weights(tmp_path / "out", _source_tensors(made), torch.float32)
    src_cfg = json.loads((made.src / "config.json").read_text())
    assert src_cfg["dtype"] == "bfloat16"
    assert (tmp_path / "out" / "config.json").read_text() == \
        json.dumps({**src_cfg, "dtype": "float32"}, indent=2, sort_keys=True) + "\n"


def test_fp32_checkpoint_exports_fp32_and_bf16_only_when_lossy_is_allowed(made, tmp_path):
    assert made.meta32["dtype"] == "fp32" and made.meta32["source_dtype"] == "bf16"
    want = _source_tensors(made)
    C.convert_megatron_to_hf(made.fp32, tmp_path / "fp32", progress=False)
    _assert_weights(tmp_path / "fp32", want, torch.float32)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(ValueError, match=r"converting torch\.float32 weights to torch\.bfloat16 loses precision; "
                                         r"pass --allow-lossy-dtype"):
        C.convert_megatron_to_hf(made.fp32, tmp_path / "refused", dtype="bf16", progress=False)
    assert not (tmp_path / "refused").exists()
    C.convert_megatron_to_hf(made.fp32, tmp_path / "bf16", dtype="bf16", allow_lossy_dtype=True, progress=False)
    _assert_weights(tmp_path / "bf16", want, torch.bfloat16)  # bf16 -> fp32 -> bf16 is exact
    assert (tmp_path / "bf16" / "config.json").read_bytes() == (made.src / "config.json").read_bytes()


def _strip_config_dtype(ckpt: Path) -> bytes:
    """Remove the dtype field of ``ckpt``'s config.json (an older config), formatted its own way."""
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["dtype"]
    raw = json.dumps(dict(reversed(list(cfg.items())))).encode()  # neither sorted nor indented
    (ckpt / "config.json").write_bytes(raw)
    return raw


@pytest.mark.parametrize("case", ["same dtype", "same dtype, meta without source_dtype", "fp32 from bf16"])
def test_config_without_dtype_field(made, tmp_path, case):
    """_write_config: a config with no dtype field is copied byte for byte when the weights keep the
    source's dtype (``source_dtype`` of the metadata, else its ``dtype``), else it gets ``dtype``."""
    ckpt = _copy(made.fp32 if case == "fp32 from bf16" else made.bf16, tmp_path / "ckpt")
    raw = _strip_config_dtype(ckpt)
    if case == "same dtype, meta without source_dtype":
        _edit_json(ckpt / model_io.META_NAME, lambda m: {k: v for k, v in m.items() if k != "source_dtype"})
    C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    got = (tmp_path / "out" / "config.json").read_bytes()
    if case == "fp32 from bf16":
        assert json.loads(got) == {**json.loads(raw), "dtype": "float32"}
    else:
        assert got == raw


WRITE_CONFIG_CASES = {  # source config, exported dtype, source dtype -> the config written (None: a copy)
    "both fields rewritten": ({"torch_dtype": "bfloat16", "b": 1, "dtype": "bfloat16", "a": [1, 2]},
                              torch.float32, torch.bfloat16,
                              {"a": [1, 2], "b": 1, "dtype": "float32", "torch_dtype": "float32"}),
    "one stale field of two": ({"dtype": "bfloat16", "torch_dtype": "float32"}, torch.bfloat16, torch.bfloat16,
                               {"dtype": "bfloat16", "torch_dtype": "bfloat16"}),
    "transformers 4 field only": ({"z": 0, "torch_dtype": "float32"}, torch.float16, torch.float32,
                                  {"torch_dtype": "float16", "z": 0}),
    "stale field, weights unchanged": ({"z": 0, "dtype": "float32"}, torch.bfloat16, torch.bfloat16,
                                       {"dtype": "bfloat16", "z": 0}),
    "field names the dtype": ({"z": 0, "dtype": "float16", "torch_dtype": "float16"}, torch.float16, torch.float32,
                              None),
    "no field, dtype kept": ({"z": 0}, torch.bfloat16, torch.bfloat16, None),
    "no field, dtype changed": ({"z": 0}, torch.float32, torch.bfloat16, {"dtype": "float32", "z": 0}),
}


@pytest.mark.parametrize("case", sorted(WRITE_CONFIG_CASES))
def test_write_config_sets_the_dtype_fields_or_copies(tmp_path, case):
    cfg, target, source, want = WRITE_CONFIG_CASES[case]
    src = tmp_path / "config.json"
    src.write_text(json.dumps(cfg))  # one line, keys unsorted: a rewrite is visible
    C._write_config(src, tmp_path / "out.json", target, source_dtype=source)
    got = (tmp_path / "out.json").read_bytes()
    if want is None:
        assert got == src.read_bytes()
    else:
        assert got.decode() == json.dumps(want, indent=2, sort_keys=True) + "\n"


def test_export_shows_a_progress_bar_by_default(made, tmp_path, capsys):
    n = len(_source_tensors(made))
    C.convert_megatron_to_hf(made.bf16, tmp_path / "out")
    err = capsys.readouterr().err
    assert re.search(rf"megatron -> hf: 100%.* {n}/{n} ", err), err[-500:]
    C.convert_megatron_to_hf(made.bf16, tmp_path / "quiet", progress=False)
    assert "megatron -> hf" not in capsys.readouterr().err


def test_export_into_a_used_folder_keeps_other_files(made, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("the user's\n")
    assert C.convert_megatron_to_hf(made.bf16, out, progress=False) == ["model.safetensors"]
    assert (out / "README.md").read_text() == "the user's\n"
    _assert_weights(out, _source_tensors(made), torch.bfloat16)


def test_export_refuses_a_file_as_out_and_the_source_folder(made, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=f"^--out {re.escape(repr(str(tmp_path / 'file')))} exists and is "
                                              "not a folder$"):
        C.convert_megatron_to_hf(made.bf16, tmp_path / "file", progress=False)
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is inside the source folder"):
        C.convert_megatron_to_hf(ckpt, ckpt / "hf", progress=False)
    assert not (ckpt / "hf").exists()


# --- conversion_meta.json -----------------------------------------------------------------------
META_CASES = {
    "not json": ('{"dtype": "bf', r"is not valid JSON \(Unterminated string"),
    "a list": ("[1]", "is a JSON list, expected an object"),
    "no conversion_version": ('{"dtype": "bf16"}', "has no 'conversion_version'"),
    "no dtype": ('{"conversion_version": 1}', "has no 'dtype'"),
    "other version": ('{"conversion_version": 2, "dtype": "bf16"}',
                      r"conversion_version 2 != 1 \(written by another version of the converter\)"),
    "unknown dtype": ('{"conversion_version": 1, "dtype": "fp8"}', r"dtype 'fp8' is not one of \['bf16', 'fp16', 'fp32'\]"),
    "dtype a list": ('{"conversion_version": 1, "dtype": ["bf16"]}', r"dtype \['bf16'\] is not one of"),
    "dtype a number": ('{"conversion_version": 1, "dtype": 16}', "dtype 16 is not one of"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_read_meta_names_the_problem(tmp_path, case):
    raw, message = META_CASES[case]
    (tmp_path / model_io.META_NAME).write_text(raw)
    path = tmp_path / model_io.META_NAME
    with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(path)))} {message}") as info:
        model_io.read_meta(tmp_path)
    assert info.value.path == str(path)


def test_read_meta_of_a_folder_without_it(tmp_path):
    path = tmp_path / model_io.META_NAME
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(repr(str(path)))} not found: is "
                                                f"{re.escape(repr(str(tmp_path)))} a converted checkpoint\\?$"):
        model_io.read_meta(tmp_path)


def test_read_meta_returns_what_the_import_wrote(made):
    assert model_io.read_meta(made.bf16) == made.meta16
    assert made.meta16["conversion_version"] == model_io.CONVERSION_VERSION and made.meta16["dtype"] == "bf16"


def test_export_checks_the_meta_before_writing(made, tmp_path):
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    _edit_json(ckpt / model_io.META_NAME, lambda m: {**m, "conversion_version": 0})
    with pytest.raises(CheckpointFormatError, match="conversion_version 0 != 1"):
        C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_hand_edited_meta_dtype_is_refused(made, tmp_path):
    """A meta claiming bf16 for fp32 weights would cast them silently: refused, naming the meta file."""
    ckpt = _copy(made.fp32, tmp_path / "ckpt")
    _edit_json(ckpt / model_io.META_NAME, lambda m: {**m, "dtype": "bf16"})
    path = ckpt / model_io.META_NAME
    with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(path)))} says dtype 'bf16' "
                                                    r"\(torch\.bfloat16\) but model/ stores \['torch\.float32'\] "
                                                    "weights$") as info:
        C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    assert info.value.path == str(path) and not (tmp_path / "out").exists()


def test_stored_weight_dtypes_ignore_fp32_norms(made):
    md = read_dist_metadata(made.bf16 / "model")
    norms = {m.properties.dtype for k, m in md.state_dict_metadata.items() if "norm" in k}
    assert norms == {torch.float32}  # megatron keeps norms in fp32 in a bf16 model
    assert stored_weight_dtypes(md) == {torch.bfloat16}
    assert stored_weight_dtypes(read_dist_metadata(made.fp32 / "model")) == {torch.float32}


# --- strict loading -----------------------------------------------------------------------------
def _extra_state_objects(num_layers: int) -> dict:
    """What TE's DotProductAttention adds to a layer's sharded state dict (one object per layer)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = "decoder.layers.self_attention.core_attention._extra_state"
    return {f"decoder.layers.{i}.self_attention.core_attention._extra_state":
            ShardedObject(key, io.BytesIO(b"fp8-meta"), (num_layers,), (i,), replica_id=0) for i in range(num_layers)}


def _edit_request(model, fn) -> None:
    """Make ``model.sharded_state_dict()`` return ``fn(request)``."""
    original = model.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        return fn(original(*args, **kwargs))

    model.sharded_state_dict = sharded_state_dict


def _bogus(n: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {f"bogus{i}.weight": ShardedTensor.from_rank_offsets(f"bogus{i}.weight", torch.zeros(3), replica_id=0)
            for i in range(n)}


def _without(keys):
    return lambda request: {k: v for k, v in request.items() if k not in keys}


def _renamed(request):
    request = dict(request)
    request["renamed.weight"] = request.pop("decoder.final_layernorm.weight")  # same checkpoint key
    return request


FINAL_NORM = "decoder.final_layernorm.weight"
MLP_FC2 = [f"decoder.layers.{i}.mlp.linear_fc2.weight" for i in range(2)]
LAYER_KEYS = ["mlp.linear_fc2.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
DROPPED6 = [FINAL_NORM, "embedding.word_embeddings.weight", "output_layer.weight",
            *(f"decoder.layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS)]  # 6 checkpoint keys
MISSING6 = sorted([FINAL_NORM, "embedding.word_embeddings.weight", "output_layer.weight",
                   *(f"decoder.layers.{k}" for k in LAYER_KEYS)])  # layers stack into one key each
STRICT_CASES = {  # edit of the request -> (where, stored but not requested, requested but not stored)
    "a key not stored": (lambda r: {**r, **_bogus(1)}, "dist", [], ["bogus0.weight"]),
    "six keys not stored": (lambda r: {**r, **_bogus(6)}, "dist", [], [f"bogus{i}.weight" for i in range(5)]),
    "a stored key not requested": (_without([FINAL_NORM]), "dist", [FINAL_NORM], []),
    "six stored keys not requested": (_without(DROPPED6), "dist", MISSING6[:5], []),
    "a key the model does not have": (_renamed, "model", ["renamed.weight"], [FINAL_NORM]),
}


@pytest.fixture
def fp32_model(made):
    """Builds fresh fp32 models of the checkpoint's config (in megatron state of one process)."""
    cfg = model_io.load_hf_config(made.fp32)
    with model_io.single_stage_parallel_state():
        yield lambda: model_io.build_model(cfg, params_dtype=torch.float32)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def loaded(made):
    """The weights of a model loaded from the fp32 checkpoint, and those of a fresh model."""
    cfg = model_io.load_hf_config(made.fp32)
    with model_io.single_stage_parallel_state():
        fresh = _weights(model_io.build_model(cfg, params_dtype=torch.float32))
        model = model_io.build_model(cfg, params_dtype=torch.float32)
        model_io.load_dist_checkpoint(model, made.fp32)
        return SimpleNamespace(weights=_weights(model), fresh=fresh)


@pytest.mark.parametrize("case", sorted(STRICT_CASES))
def test_load_refuses_keys_that_differ(made, fp32_model, case):
    edit, where, stored, requested = STRICT_CASES[case]
    model = fp32_model()
    _edit_request(model, edit)
    where = f"dist checkpoint {str(made.fp32 / 'model')!r}" if where == "dist" else "model.load_state_dict"
    with pytest.raises(ValueError, match=f"^{re.escape(where)}: keys stored but not in the model: "
                                         f"{re.escape(str(stored))}; keys of the model not stored: "
                                         rf"{re.escape(str(requested))} \(only TE _extra_state may differ\)$"):
        model_io.load_dist_checkpoint(model, made.fp32)


def test_load_gives_the_checkpoint_weights(made, loaded):
    src, fresh, loaded = _source_tensors(made), loaded.fresh, loaded.weights
    assert torch.equal(loaded["embedding.word_embeddings.weight"], src["model.embed_tokens.weight"].float())
    assert torch.equal(loaded[FINAL_NORM], src["model.norm.weight"].float())
    assert torch.equal(loaded[MLP_FC2[1]], src["model.layers.1.mlp.down_proj.weight"].float())
    fc1 = loaded["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([src[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]).float())
    assert not torch.equal(fresh[MLP_FC2[1]], loaded[MLP_FC2[1]])  # the load did change the model


def test_te_extra_state_request_is_tolerated(made, fp32_model, loaded):
    """A TE model asks for core_attention._extra_state, which a local-spec checkpoint lacks."""
    model = fp32_model()
    _edit_request(model, lambda r: {**r, **_extra_state_objects(2)})
    model_io.load_dist_checkpoint(model, made.fp32)
    got, want = _weights(model), loaded.weights
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_te_written_checkpoint_exports_the_same_weights(made, tmp_path):
    """A checkpoint holding TE extra states the local model does not ask for still converts back."""
    from megatron.core import dist_checkpointing

    te = tmp_path / "te"
    (te / model_io.MODEL_SUBDIR).mkdir(parents=True)
    for f in ("config.json", model_io.META_NAME):
        shutil.copyfile(made.fp32 / f, te / f)
    with model_io.single_stage_parallel_state():
        model = model_io.build_model(model_io.load_hf_config(made.fp32), params_dtype=torch.float32)
        model_io.load_dist_checkpoint(model, made.fp32)
        request = {**mcore_save._whole_gated_fc1(model.sharded_state_dict()), **_extra_state_objects(2)}
        dist_checkpointing.save(request, str(te / model_io.MODEL_SUBDIR),
                                sharded_strategy=mcore_save._save_strategy())
    assert any("core_attention._extra_state" in k for k in read_dist_metadata(te / "model").state_dict_metadata)
    C.convert_megatron_to_hf(te, tmp_path / "out", progress=False)
    _assert_weights(tmp_path / "out", _source_tensors(made), torch.float32)


def test_check_only_extra_state_lists_five_keys_per_side():
    keys = [f"k{i}.weight" for i in range(7)] + ["x._extra_state"]
    with pytest.raises(ValueError, match=re.escape(f"here: keys stored but not in the model: {keys[:5]}; keys of "
                                                   f"the model not stored: {keys[2:7]} (only TE")):
        model_io._check_only_extra_state(keys, keys[2:], "here")
    model_io._check_only_extra_state(["a._extra_state"], ["b.core_attention._extra_state"], "here")


# --- safe_load: what torch would unpickle -------------------------------------------------------
def test_crafted_metadata_pickle_is_refused_before_it_runs(made, tmp_path):
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    path = ckpt / "model" / ".metadata"
    path.write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=f"^{re.escape(repr(str(path)))} references posix\\.system, which "
                                                    "torch never writes into checkpoint metadata; refusing to unpickle "
                                                    r"it \(a crafted file runs code this way\)\. Only load checkpoints "
                                                    "you trust$") as info:
        C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    assert info.value.path == str(path)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_metadata_with_a_persistent_id_is_refused(made, tmp_path):
    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, str) and obj == "x" else None

    buf = io.BytesIO()
    Persistent(buf).dump(["x"])
    model = _copy(made.bf16, tmp_path / "ckpt") / "model"
    (model / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="holds a persistent id, which checkpoint metadata never does$") \
            as info:
        check_dist_checkpoint(model)
    assert info.value.path == str(model / ".metadata")


def test_crafted_byte_item_is_refused_before_it_runs(made, tmp_path):
    """A linear layer's _extra_state byte item replaced by a pickle that runs code (torch would load it
    with weights_only=False)."""
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    md = read_dist_metadata(ckpt / "model")
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn.endswith("_extra_state/shard_0_2"))
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(marker), protocol=2)
    with open(ckpt / "model" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(payload + bytes(info.length - len(payload)))
    with pytest.raises(UnsafeCheckpointError, match=f"^{re.escape(repr(str(ckpt / 'model')))} byte item "
                                                    f"{re.escape(repr(index.fqn))} does not load with "
                                                    r"weights_only=True \(.*\); refusing it$") as exc:
        C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    assert exc.value.path == str(ckpt / "model") and not marker.exists()


# --- safe_load: files present, whole, and what they say they are --------------------------------
def _truncate(path: Path, nbytes: int) -> None:
    path.write_bytes(path.read_bytes()[:nbytes])


def _write_metadata(model: Path, md) -> None:
    (model / ".metadata").write_bytes(pickle.dumps(md))


def _storage(md, *, transform) -> None:
    """Replace the first storage entry of ``md`` by ``transform(entry)``."""
    first = next(iter(md.storage_data))
    md.storage_data[first] = transform(md.storage_data[first])


def _weird_index(info):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    obj = MetadataIndex("not storage")
    object.__setattr__(obj, "relative_path", info.relative_path)  # a file name, on the wrong class
    return obj


def _si(info, **kw):
    import dataclasses

    return dataclasses.replace(info, **kw)


DAMAGE = {  # damage(model dir) -> (file named, message)
    "no .metadata": (lambda m: (m / ".metadata").unlink(), ".metadata",
                     "is missing: not a torch_dist checkpoint folder, or an incomplete one"),
    "truncated .metadata": (lambda m: _truncate(m / ".metadata", 100), ".metadata",
                            r"cannot be read \((EOFError|UnpicklingError): .*\): truncated or not a torch_dist "
                            "checkpoint"),
    "garbled .metadata": (lambda m: (m / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata",
                          r"cannot be read \(UnpicklingError: .*\): truncated or not a torch_dist checkpoint"),
    ".metadata of a dict": (lambda m: (m / ".metadata").write_bytes(pickle.dumps({"a": 1})), ".metadata",
                            "holds a dict, not checkpoint metadata"),
    "no common state": (lambda m: _drop_common_state(m), "common.pt",
                        r"is missing, and \.metadata names no 'common_state/shard_0_1' item \(megatron-core 0\.19's "
                        r"place for the common state\): the checkpoint is incomplete"),
    "no metadata.json": (lambda m: (m / "metadata.json").unlink(), "metadata.json",
                         "is missing: the checkpoint is incomplete"),
    "metadata.json not json": (lambda m: (m / "metadata.json").write_text("{"), "metadata.json",
                               r"is not valid JSON \(Expecting property name enclosed in double quotes: line 1 column 2 "
                               r"\(char 1\)\)"),
    "metadata.json a list": (lambda m: (m / "metadata.json").write_text("[1]"), "metadata.json",
                             r"does not name the torch_dist backend: \[1\]"),
    "metadata.json other backend": (lambda m: (m / "metadata.json").write_text('{"sharded_backend": "zarr"}'),
                                    "metadata.json", "does not name the torch_dist backend: {'sharded_backend': 'zarr'}"),
    "no distcp": (lambda m: (m / "__0_0.distcp").unlink(), "__0_0.distcp",
                  r"is missing \(named by \.metadata\): the checkpoint is incomplete"),
    "distcp one byte short": (lambda m: _truncate(m / "__0_0.distcp", (m / "__0_0.distcp").stat().st_size - 1),
                              "__0_0.distcp", "is (?P<short>\\d+) bytes, but \\.metadata places data up to byte "
                              "(?P<end>\\d+): truncated"),
}


def _drop_common_state(model: Path) -> None:
    """Delete the common state, in whichever format ``model`` keeps it (common.pt or the .distcp item)."""
    if (model / "common.pt").exists():
        (model / "common.pt").unlink()
    md = read_dist_metadata(model)
    index = [i for i in md.storage_data if i.fqn == COMMON_STATE_KEY]
    if index:
        del md.state_dict_metadata[COMMON_STATE_KEY], md.storage_data[index[0]]
        _write_metadata(model, md)


@pytest.mark.parametrize("fmt", ["0.16", "0.19"])
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_dist_checkpoint_is_named(made, tmp_path, case, fmt):
    """Each damage, in the format megatron-core 0.16 writes (common.pt) and in 0.19's (the common
    state inside __0_0.distcp), whichever megatron wrote the fixture."""
    damage, name, message = DAMAGE[case]
    model = _copy(made.bf16, tmp_path / "ckpt") / "model"
    rewrite_common_state(model, fmt)
    size = (model / "__0_0.distcp").stat().st_size
    damage(model)
    with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(model / name)))} {message}$") as info:
        check_dist_checkpoint(model)
    assert info.value.path == str(model / name)
    m = re.search(message, info.value.why)
    if "short" in m.groupdict():
        assert (int(m["short"]), int(m["end"])) == (size - 1, size)


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^no dist checkpoint at {re.escape(repr(str(tmp_path / 'model')))}$"):
        check_dist_checkpoint(tmp_path / "model")


STORAGE_CASES = {
    "not a storage record": lambda info: 5,
    "a path outside the folder": lambda info: _si(info, relative_path="../__0_0.distcp"),
    "a path that is not a string": lambda info: _si(info, relative_path=5),
    "a file name on another class": _weird_index,
}


@pytest.mark.parametrize("case", sorted(STORAGE_CASES))
def test_storage_entry_outside_the_folder_is_refused(made, tmp_path, case):
    model = _copy(made.bf16, tmp_path / "ckpt") / "model"
    md = read_dist_metadata(model)
    _storage(md, transform=STORAGE_CASES[case])
    _write_metadata(model, md)
    with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(model / '.metadata')))} storage entry of "
                                                    r"MetadataIndex\(.*\) is .*, not a file in the checkpoint folder$"):
        check_dist_checkpoint(model)


def test_truncation_is_found_whatever_the_entry_order(made, tmp_path):
    model = _copy(made.bf16, tmp_path / "ckpt") / "model"
    md = read_dist_metadata(model)
    md.storage_data = dict(reversed(list(md.storage_data.items())))  # the last bytes' entry first
    _write_metadata(model, md)
    size = (model / "__0_0.distcp").stat().st_size
    assert check_dist_checkpoint(model).storage_data == md.storage_data  # whole: accepted
    _truncate(model / "__0_0.distcp", size - 1)
    with pytest.raises(CheckpointFormatError, match=f"is {size - 1} bytes, but .metadata places data up to byte "
                                                    f"{size}: truncated"):
        check_dist_checkpoint(model)


def test_zero_length_items_need_no_bytes(made, tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    model = _copy(made.bf16, tmp_path / "ckpt") / "model"
    md = read_dist_metadata(model)
    first = next(iter(md.storage_data.values()))
    md.storage_data[MetadataIndex("empty")] = _si(first, relative_path="__empty.distcp", offset=0, length=0)
    _write_metadata(model, md)
    (model / "__empty.distcp").write_bytes(b"")
    assert MetadataIndex("empty") in check_dist_checkpoint(model).storage_data


# --- the save strategy and megatron's private writer internals ----------------------------------
def test_saved_checkpoint_format(made):
    """What the installed megatron-core writes (one writer): 0.16.1 a common.pt, 0.19.2 the common
    state as a byte item of __0_0.distcp (what rewrite_common_state builds for the other format)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model = made.bf16 / "model"
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    md = read_dist_metadata(model)
    if megatron_reads_common_state():
        assert sorted(os.listdir(model)) == [".metadata", "__0_0.distcp", "metadata.json"]
        assert json.loads((model / "metadata.json").read_text()) == backend
        assert isinstance(md.state_dict_metadata[COMMON_STATE_KEY], BytesStorageMetadata)
        (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == COMMON_STATE_KEY]
        assert info.relative_path == "__0_0.distcp" and not info.transform_descriptors
        with open(model / info.relative_path, "rb") as f:
            f.seek(info.offset)
            assert torch.load(io.BytesIO(f.read(info.length)), weights_only=True) == [{}]
    else:
        assert sorted(os.listdir(model)) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
        assert json.loads((model / "metadata.json").read_text()) == {
            **backend, "common_backend": "torch", "common_backend_version": 1}
        assert COMMON_STATE_KEY not in md.state_dict_metadata
        assert torch.load(model / "common.pt", weights_only=True) == {}


@pytest.mark.parametrize("fmt", ["0.16", "0.19"])
def test_both_common_state_formats_export_bit_exact(made, tmp_path, fmt):
    """A checkpoint in 0.16's format and one in 0.19's: both pass safe_load and export the source's
    weights bit for bit where the installed megatron-core reads that format; 0.16.1 given 0.19's is one
    line naming the folder and the version to use."""
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    rewrite_common_state(ckpt / "model", fmt)
    again = sorted(os.listdir(ckpt / "model"))
    rewrite_common_state(ckpt / "model", fmt)  # already in that format: unchanged
    assert sorted(os.listdir(ckpt / "model")) == again
    if fmt == "0.19" and not megatron_reads_common_state():
        from megatron.core import package_info

        with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(ckpt / 'model')))} keeps its common "
                                                        r"state in the \.distcp files \('common_state/shard_0_1', "
                                                        r"written by megatron-core >= 0\.19\), which the installed "
                                                        f"megatron-core {re.escape(package_info.__version__)} cannot "
                                                        r"read: load it with megatron-core>=0\.19$"):
            C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
        return
    C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    _assert_weights(tmp_path / "out", _source_tensors(made), torch.bfloat16)


def test_crafted_common_state_item_is_refused_before_it_runs(made, tmp_path):
    """0.19's common_state/shard_0_1 replaced by a pickle that runs code (torch's planner loads byte
    items with weights_only=False): refused by check_dist_checkpoint, naming the file and the item,
    with any megatron-core, before the export reads anything."""
    ckpt = _copy(made.bf16, tmp_path / "ckpt")
    model = ckpt / "model"
    rewrite_common_state(model, "0.19")
    md = read_dist_metadata(model)
    info = next(s for i, s in md.storage_data.items() if i.fqn == COMMON_STATE_KEY)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save([RunsCode(marker)], buf)
    with open(model / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(buf.getvalue())
    md.storage_data[next(i for i in md.storage_data if i.fqn == COMMON_STATE_KEY)] = type(info)(
        relative_path=info.relative_path, offset=offset, length=len(buf.getvalue()))
    _write_metadata(model, md)
    with pytest.raises(UnsafeCheckpointError, match=f"^{re.escape(repr(str(model / info.relative_path)))} byte item "
                                                    r"'common_state/shard_0_1' does not load with weights_only=True "
                                                    r"\(.*\); refusing it$"):
        C.convert_megatron_to_hf(ckpt, tmp_path / "out", progress=False)
    assert not marker.exists() and not (tmp_path / "out").exists()


class _Request:
    """Stands in for megatron's AsyncRequest (the checks go by attribute, function name and arguments)."""

    def __init__(self, async_fn, args=(0, "buckets", "results"), *, preload_fn=None, finalize_fns=()):
        self.async_fn, self.async_fn_args = async_fn, list(args)
        self.preload_fn, self.finalize_fns = preload_fn, list(finalize_fns)


def write_preloaded_data_multiproc(transform_list, use_msc, rank, write_buckets, results):
    """Named like megatron 0.16's writer."""


def write_preloaded_data_multithread(transform_list, use_msc, rank, write_buckets, results):
    """Named like megatron 0.17's writer."""


class _Nameless:
    def __call__(self, *args):
        pass

    def __repr__(self):
        return "Nameless()"


def _without_attr(attr):
    request = _Request(functools.partial(write_preloaded_data_multiproc, [], False))
    delattr(request, attr)
    return request


def test_known_write_functions_are_accepted():
    multiproc = functools.partial(write_preloaded_data_multiproc, ["t"], False)
    assert mcore_save._checked_write_fn(_Request(multiproc)) == ("write_preloaded_data_multiproc", (["t"], False),
                                                        (0, "buckets", "results"))
    multithread = functools.partial(write_preloaded_data_multithread, ["t"], True)
    assert mcore_save._checked_write_fn(_Request(multithread, (1, [], None))) == ("write_preloaded_data_multithread",
                                                                         (["t"], True), (1, [], None))
    assert mcore_save._checked_write_fn(_Request(None)) is None  # this rank writes nothing


WRITE_FN_CASES = {
    "no async_fn": (lambda: _without_attr("async_fn"), "the async save request _Request has no 'async_fn'"),
    "no async_fn_args": (lambda: _without_attr("async_fn_args"), "the async save request _Request has no "
                                                                 "'async_fn_args'"),
    "no preload_fn": (lambda: _without_attr("preload_fn"), "the async save request _Request has no 'preload_fn'"),
    "no finalize_fns": (lambda: _without_attr("finalize_fns"), "the async save request _Request has no "
                                                               "'finalize_fns'"),
    "not a partial": (lambda: _Request(write_preloaded_data_multiproc),
                      "async_fn is a function, expected functools.partial"),
    "another function": (lambda: _Request(functools.partial(print, [], False)),
                         "async_fn wraps 'print', expected one of ('write_preloaded_data_multiproc', "
                         "'write_preloaded_data_multithread')"),
    "a nameless callable": (lambda: _Request(functools.partial(_Nameless(), [], False)),
                            "async_fn wraps 'Nameless()', expected one of"),
    "one bound argument": (lambda: _Request(functools.partial(write_preloaded_data_multiproc, [])),
                           "write_preloaded_data_multiproc is bound to 1 positional / [] keyword arguments, "
                           "expected (transform_list, use_msc)"),
    "a bound keyword": (lambda: _Request(functools.partial(write_preloaded_data_multithread, [], False, extra=1)),
                        "write_preloaded_data_multithread is bound to 2 positional / ['extra'] keyword arguments, "
                        "expected (transform_list, use_msc)"),
    "two call arguments": (lambda: _Request(functools.partial(write_preloaded_data_multiproc, [], False), (0, [])),
                           "async_fn_args has 2 entries, expected (rank, write_buckets, results_queue)"),
    "four call arguments": (lambda: _Request(functools.partial(write_preloaded_data_multiproc, [], False),
                                             (0, [], None, None)),
                            "async_fn_args has 4 entries, expected (rank, write_buckets, results_queue)"),
}


@pytest.mark.parametrize("case", sorted(WRITE_FN_CASES))
def test_unknown_save_internals_are_refused(case):
    from megatron.core import package_info

    make, detail = WRITE_FN_CASES[case]
    with pytest.raises(RuntimeError, match=f"^{UNSUPPORTED}{re.escape(detail)}") as info:
        mcore_save._checked_write_fn(make())
    assert re.match(UNSUPPORTED, str(info.value))["v"] == package_info.__version__


def test_changed_write_preloaded_data_signature_is_refused(monkeypatch):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(lambda bucket, queue: None))
    detail = ("FileSystemWriterAsync.write_preloaded_data takes ('bucket', 'queue'), expected ('transform_list', "
              "'local_proc_idx', 'write_bucket', 'results_queue', 'count_queue', 'use_fsync') first")
    with pytest.raises(RuntimeError, match=f"^{UNSUPPORTED}{re.escape(detail)}$"):
        mcore_save._checked_write_fn(_Request(functools.partial(write_preloaded_data_multiproc, [], False)))
    # megatron 0.17+ writes with its own function: our in-process writer (and its check) is not used.
    multithread = functools.partial(write_preloaded_data_multithread, [], False)
    assert mcore_save._checked_write_fn(_Request(multithread))[0] == "write_preloaded_data_multithread"


@pytest.fixture
def parallel_state():
    with model_io.single_stage_parallel_state():
        yield


@pytest.mark.parametrize("cuda", [False, True])
def test_strategy_runs_megatrons_multithread_writer_itself(parallel_state, monkeypatch, cuda):
    """megatron 0.17+: async_save(..., async_strategy="mcore"), then its writer and the finalize
    functions in this process; the preload (device -> host) only with CUDA."""
    calls = []

    def writer(transform_list, use_msc, rank, buckets, results):
        calls.append(("write", transform_list, use_msc, rank, buckets, results))

    writer.__name__ = "write_preloaded_data_multithread"
    request = _Request(functools.partial(writer, ["t"], False), (0, "host buckets", "queue"),
                       preload_fn=lambda: "preloaded buckets", finalize_fns=[lambda: calls.append("finalize")])

    def async_save(sharded_state_dict, checkpoint_dir, async_strategy="nvrx"):
        calls.append(("async_save", sharded_state_dict, checkpoint_dir, async_strategy))
        return request

    strategy = mcore_save._save_strategy()
    strategy.async_save = async_save
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    strategy.save({"w": 1}, "/ckpt")
    buckets = "preloaded buckets" if cuda else "host buckets"
    assert calls == [("async_save", {"w": 1}, "/ckpt", "mcore"), ("write", ["t"], False, 0, buckets, "queue"),
                     "finalize"]


def test_strategy_with_nothing_to_write_still_finalizes(parallel_state):
    calls = []
    strategy = mcore_save._save_strategy()
    strategy.async_save = lambda sd, d: calls.append("async_save") or _Request(
        None, finalize_fns=[lambda: calls.append("finalize")])
    strategy.save({}, "/ckpt")
    assert calls == ["async_save", "finalize"]


def _bucket(path: Path, fqn: str, data: bytes):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    item = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
    return str(path), path.name, ([(item, io.BytesIO(data))], [])


def _transforms():
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

    return [_StorageWriterTransforms()]


def test_in_process_writer_reports_each_bucket(tmp_path, monkeypatch):
    """megatron 0.16's results protocol: {bucket index: write results}, each file fsynced."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    results = queue.Queue()
    buckets = [_bucket(tmp_path / "__0_0.distcp", "a", b"first"), _bucket(tmp_path / "__0_1.distcp", "b", b"second!")]
    mcore_save._write_buckets_in_process(_transforms(), False, 0, buckets, results)
    out = results.get_nowait()
    assert sorted(out) == [0, 1] and results.empty()
    for i, (name, fqn, data) in enumerate([("__0_0.distcp", "a", b"first"), ("__0_1.distcp", "b", b"second!")]):
        (res,) = out[i]
        assert res.index.fqn == fqn and res.size_in_bytes == len(data)
        assert (res.storage_data.relative_path, res.storage_data.offset, res.storage_data.length) == (name, 0, len(data))
        assert (tmp_path / name).read_bytes() == data
    assert len(synced) == 2


def test_in_process_writer_reports_the_first_failure(tmp_path):
    results = queue.Queue()
    buckets = [_bucket(tmp_path / "missing" / "__0_0.distcp", "a", b"x"), _bucket(tmp_path / "__0_1.distcp", "b", b"y")]
    mcore_save._write_buckets_in_process(_transforms(), False, 0, buckets, results)
    err = results.get_nowait()
    assert isinstance(err, FileNotFoundError) and str(tmp_path / "missing") in str(err) and results.empty()
    assert not (tmp_path / "__0_1.distcp").exists()  # nothing written after the failure


def test_in_process_writer_passes_use_msc_on(tmp_path):
    """use_msc (bound by megatron) reaches its writer: without multistorageclient the write fails."""
    try:
        import multistorageclient  # noqa: F401
        pytest.skip("multistorageclient is installed")
    except ImportError:
        pass
    results = queue.Queue()
    mcore_save._write_buckets_in_process(_transforms(), True, 0, [_bucket(tmp_path / "__0_0.distcp", "a", b"x")],
                                         results)
    err = results.get_nowait()
    assert isinstance(err, ModuleNotFoundError) and err.name == "multistorageclient"
