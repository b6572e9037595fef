"""HF -> megatron conversion run in the pytest process: what ``convert_hf_to_megatron`` writes, and what
it refuses to write.

The other conversion tests convert in a subprocess (``tests/conversion/test_checkpoint_files.py``,
``tests/conversion/test_checkpoint_bad_input.py``), which a mutation run cannot trace; here every conversion runs in
this process (a world-size-1 gloo group made by ``single_stage_parallel_state``), on a two-layer Qwen2
with every tensor drawn afresh (``write_random_hf_checkpoint``), so that a tensor loaded into the wrong
parameter, layer or half of fc1 changes a value the tests compare bit for bit.

Checked: ``conversion_meta.json`` exactly (every key, value and byte); the stored weights against the
HF tensors (loaded back with ``build_model`` + ``load_dist_checkpoint``), in the stored dtype; fc1
saved as one ``[gate; up]`` tensor per layer; dtype choices (the source's by default, fp32 on request,
lossy casts refused unless allowed, the source dtype named in the metadata, mixed sources); the
progress bar; the output folder rules (inside the source, a file, not empty, ``overwrite`` replacing
only the converter's entries, the hidden staging folder removed, a new folder removed after a failure,
the metadata moved into place last, a clean-up that never hides the error); ``config.json`` and
tokenizer files copied byte for byte; ``build_model``'s TP = PP = 1 local-spec model; and a clear
error, before anything is written, for each bad input.

Saving a dist checkpoint starts megatron's spawn ``Manager`` once per process (~5 s); every later
conversion of this tiny model takes a fraction of a second, so the conversions are shared through
module-scoped fixtures.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_credit.conversion import converters as C, mcore_save, model_io
from megatron_credit.conversion.hf_io import CheckpointFormatError, SafetensorsReader
from megatron_credit.conversion.testing import tiny_hf_config, write_random_hf_checkpoint

VOCAB = 160  # divisible by the planned tp = 2
LAYERS = 2
FFN = 96  # tiny_hf_config's intermediate_size
HIDDEN = 64
TOKENIZER = {"tokenizer_config.json": '{"model_max_length": 64}\n', "chat_template.jinja": "{{ messages }}\n"}


def _cfg():
    return tiny_hf_config("qwen2", vocab_size=VOCAB, num_hidden_layers=LAYERS)


def _rewrite(folder: Path, fn) -> None:
    """Replace ``folder/model.safetensors`` by ``fn(tensors)``."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = fn(load_file(str(path)))
    save_file(tensors, str(path), metadata={"format": "pt"})


_BASES: dict[tuple[Path, torch.dtype], Path] = {}


def _hf_dir(folder: Path, *, dtype=torch.bfloat16, tokenizer: bool = True, edit=None) -> Path:
    """A copy of the random checkpoint of ``dtype`` (written once per dtype), tokenizer files added and
    its tensors edited by ``edit``."""
    key = (folder.parent, dtype)
    if key not in _BASES:
        _BASES[key] = folder.parent / f"random_{str(dtype).removeprefix('torch.')}"
        write_random_hf_checkpoint(_cfg(), _BASES[key], dtype=dtype, seed=len(_BASES))
    shutil.copytree(_BASES[key], folder)
    if tokenizer:
        for name, text in TOKENIZER.items():
            (folder / name).write_text(text)
        (folder / "README.md").write_text("not a tokenizer file\n")
    if edit is not None:
        _rewrite(folder, edit)
    return folder


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


def _convert(src, out, **kw):
    """A conversion with its stderr (the progress bar) captured: ``(metadata, stderr text)``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        meta = C.convert_hf_to_megatron(src, out, **kw)
    return meta, err.getvalue()


def _expected_meta(src: Path, *, dtype: str, source_dtype: str, tp: int = 1, pp: int = 1,
                   tokenizer: bool = True) -> dict:
    return {"conversion_version": 1, "source_architecture": ["Qwen2ForCausalLM"], "family": "qwen2",
            "dtype": dtype, "source_dtype": source_dtype, "format": "torch_dist", "planned_tp": tp,
            "planned_pp": pp, "tokenizer_files": list(TOKENIZER) if tokenizer else [],
            "import_parts": 1, "layers_per_part": LAYERS, "source_bytes": (src / "model.safetensors").stat().st_size}


def _loaded_state(ckpt: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights of ``ckpt`` loaded into a fresh TP = PP = 1 model of ``dtype``."""
    with model_io.single_stage_parallel_state():
        model = model_io.build_model(model_io.load_hf_config(ckpt), params_dtype=dtype)
        model_io.load_dist_checkpoint(model, ckpt)
        return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _assert_weights(ckpt: Path, src: Path, dtype: torch.dtype) -> None:
    """Every stored weight is the HF tensor (rounded to ``dtype``; layer norms stay fp32), bit for bit."""
    from megatron_credit.families import family_for_config
    from megatron_credit.conversion.safe_load import read_dist_metadata, stored_weight_dtypes
    from megatron_credit.conversion.streaming import iter_megatron_from_hf

    assert stored_weight_dtypes(read_dist_metadata(ckpt / model_io.MODEL_SUBDIR)) == {dtype}
    state = _loaded_state(ckpt, dtype)
    cfg, reader = model_io.load_hf_config(src), SafetensorsReader(src)
    want = dict(iter_megatron_from_hf(reader.get, family_for_config(cfg), cfg))
    assert sorted(state) == sorted(want)
    for name, t in state.items():
        assert t.dtype == (torch.float32 if "norm" in name else dtype), name
        assert torch.equal(t, want[name].to(t.dtype)), name
    for i in range(LAYERS):  # fc1 is [gate; up], rows [0, F) the gate
        gate, up = (reader.get(f"model.layers.{i}.mlp.{p}_proj.weight") for p in ("gate", "up"))
        assert torch.equal(state[f"decoder.layers.{i}.mlp.linear_fc1.weight"], torch.cat([gate, up]).to(dtype))
    emb = state["embedding.word_embeddings.weight"]
    assert torch.equal(emb, reader.get("model.embed_tokens.weight").to(dtype))
    assert not torch.equal(emb, state["output_layer.weight"])


# --- fixtures: the conversions ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("inprocess_import")


@pytest.fixture(scope="module")
def src(root):
    """bf16 source with the fp32 ``rotary_emb.inv_freq`` buffers old checkpoints stored (not weights)."""
    def add_inv_freq(t):
        inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.arange(1.0, 9.0) for i in range(LAYERS)}
        return {**t, **inv_freq}
    return _hf_dir(root / "src", edit=add_inv_freq)


@pytest.fixture(scope="module")
def default_run(root, src):
    """Defaults everywhere (dtype, tp, pp, progress, overwrite) into a folder whose parents do not exist."""
    out = root / "new" / "deeper" / "mc"
    meta, err = _convert(str(src), str(out))
    return out, meta, err


@pytest.fixture(scope="module")
def fp32_run(root, src):
    """fp32 on request, planned tp = pp = 2, no progress bar, into an existing empty folder."""
    out = root / "mc_fp32"
    out.mkdir()
    meta, err = _convert(src, out, dtype="fp32", tp=2, pp=2, progress=False)
    return out, meta, err


@pytest.fixture(scope="module")
def mixed_src(root):
    """bf16 weights, but the final norm stored in fp64: a mixed and partly lossy source."""
    return _hf_dir(root / "src_mixed", tokenizer=False,
                   edit=lambda t: {**t, "model.norm.weight": t["model.norm.weight"].double() + 1e-12})


@pytest.fixture(scope="module")
def bad_shape_src(root):
    """layer 0's down_proj stored transposed: found only while the model is filled (in the staging folder)."""
    return _hf_dir(root / "src_bad_shape", tokenizer=False, edit=lambda t: {
        **t, "model.layers.0.mlp.down_proj.weight": t["model.layers.0.mlp.down_proj.weight"].t().contiguous()})


# --- what a conversion writes ----------------------------------------------------------------------
def test_default_conversion_writes_exact_metadata_last_file(default_run, src):
    out, meta, _ = default_run
    want = _expected_meta(src, dtype="bf16", source_dtype="bf16")  # the fp32 inv_freq does not count
    assert meta == want
    assert (out / model_io.META_NAME).read_text() == json.dumps(want, indent=2) + "\n"
    assert model_io.read_meta(out) == want
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", model_io.META_NAME, "model", *TOKENIZER])


def test_default_conversion_stores_the_hf_tensors_bit_exact(default_run, src):
    _assert_weights(default_run[0], src, torch.bfloat16)


def test_config_and_tokenizer_files_are_copied_byte_for_byte(default_run, src):
    out = default_run[0]
    for name in ("config.json", *TOKENIZER):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "README.md").exists()


def test_fc1_is_saved_as_one_gate_up_tensor_per_layer(default_run):
    """Not megatron's two halves per layer (see ``_whole_gated_fc1``): one chunk [1, 2F, H] per layer."""
    from megatron_credit.conversion.safe_load import read_dist_metadata

    md = read_dist_metadata(default_run[0] / model_io.MODEL_SUBDIR).state_dict_metadata
    fc1 = md["decoder.layers.mlp.linear_fc1.weight"]
    assert tuple(fc1.size) == (LAYERS, 2 * FFN, HIDDEN)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in fc1.chunks) == [
        ((i, 0, 0), (1, 2 * FFN, HIDDEN)) for i in range(LAYERS)]


def test_progress_bar_counts_the_hf_tensors_read(default_run, fp32_run):
    n = 27  # every HF tensor once (2 layers x 12 + embedding, final norm, lm_head), not the inv_freq buffers
    err = default_run[2]
    assert re.search(rf"hf -> megatron: 100%\|.*\| {n}/{n} \[.*tensor/s\]", err), err
    assert f"{n + 1}/{n}" not in err and "it/s" not in err
    assert "hf -> megatron" not in fp32_run[2]  # progress=False


def test_fp32_on_request_with_planned_parallel_sizes(fp32_run, src):
    out, meta, _ = fp32_run
    want = _expected_meta(src, dtype="fp32", source_dtype="bf16", tp=2, pp=2)
    assert meta == want and json.loads((out / model_io.META_NAME).read_text()) == want
    _assert_weights(out, src, torch.float32)


def test_mixed_source_is_named_and_lossy_part_needs_consent(root, mixed_src):
    out = root / "mc_mixed"
    with pytest.raises(ValueError, match=r"mixes dtypes \['torch\.bfloat16', 'torch\.float64'\]; pass --dtype"):
        C.convert_hf_to_megatron(mixed_src, out, progress=False)
    with pytest.raises(ValueError, match="converting torch.float64 weights to torch.float32 loses precision; "
                                         "pass --allow-lossy-dtype"):
        C.convert_hf_to_megatron(mixed_src, out, dtype="fp32", progress=False)
    assert not out.exists()
    meta, _ = _convert(mixed_src, out, dtype="fp32", allow_lossy_dtype=True, progress=False)
    assert meta == _expected_meta(mixed_src, dtype="fp32", source_dtype="mixed(bf16,float64)", tokenizer=False)
    _assert_weights(out, mixed_src, torch.float32)


def test_lossy_target_is_refused_by_default(root):
    src = _hf_dir(root / "src_fp32", dtype=torch.float32, tokenizer=False)
    out = root / "mc_lossy"
    with pytest.raises(ValueError, match="converting torch.float32 weights to torch.bfloat16 loses precision; "
                                         "pass --allow-lossy-dtype"):
        C.convert_hf_to_megatron(src, out, dtype="bf16", progress=False)
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'; valid: \['bf16', 'fp16', 'fp32'\]"):
        C.convert_hf_to_megatron(src, out, dtype="fp8", progress=False)
    assert not out.exists()


def test_whole_gated_fc1_keeps_the_parameter_and_recurses():
    """fc1 becomes one ShardedTensor over the parameter itself (no copy), also inside a nested request;
    every other entry is passed on as it is."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    with model_io.single_stage_parallel_state():
        model = model_io.build_model(_cfg(), params_dtype=torch.float32)
        request = model.sharded_state_dict()
        extra = object()
        nested = mcore_save._whole_gated_fc1({"model": request, "other": extra})
        params = dict(model.named_parameters())
    assert set(nested) == {"model", "other"} and nested["other"] is extra
    got = nested["model"]
    assert list(got) == list(request)
    fc1 = [k for k, v in request.items() if isinstance(v, ShardedTensorFactory)]
    assert fc1 == [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(LAYERS)]
    for k, v in request.items():
        if k not in fc1:
            assert got[k] is v, k
    for i, k in enumerate(fc1):
        st = got[k]
        assert isinstance(st, ShardedTensor) and st.key == "decoder.layers.mlp.linear_fc1.weight"
        assert st.data is params[k]
        assert (st.global_shape, st.global_offset, st.local_shape) == ((LAYERS, 2 * FFN, HIDDEN), (i, 0, 0),
                                                                      (2 * FFN, HIDDEN))
        assert st.prepend_axis_num == 1 and st.replica_id == request[k].replica_id


def test_build_model_is_the_local_tp1_pp1_model_unless_asked(monkeypatch):
    """The converters' model: TP = PP = 1 by default (a vocabulary of 131 rows has no TP = 2 model), the
    local spec even where Transformer Engine and CUDA are available (the checkpoint's keys and
    ``_extra_state`` entries are the local spec's), and the sizes asked for are checked against the model."""
    from megatron_credit.models import gpt

    cfg = tiny_hf_config("qwen2", num_hidden_layers=2)
    assert cfg.vocab_size == 131
    with pytest.raises(ValueError, match="parallel.tensor_model_parallel_size=3 does not divide num_attention_heads=4"):
        model_io.build_model(cfg, params_dtype=torch.float32, tp=3)
    with pytest.raises(ValueError, match="parallel.pipeline_model_parallel_size=3 does not divide num_hidden_layers=2"):
        model_io.build_model(cfg, params_dtype=torch.float32, pp=3)
    with model_io.single_stage_parallel_state():
        with monkeypatch.context() as m:
            m.setattr(gpt, "transformer_engine_available", lambda: True)
            m.setattr(torch.cuda, "is_available", lambda: True)
            model = model_io.build_model(cfg, params_dtype=torch.float16)
        names = {k: v.dtype for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert (model.config.tensor_model_parallel_size, model.config.pipeline_model_parallel_size) == (1, 1)
    assert model.config.params_dtype == torch.float16
    assert names["decoder.layers.1.input_layernorm.weight"] == torch.float32  # local spec norms, fp32
    assert names["decoder.layers.1.mlp.linear_fc1.weight"] == torch.float16
    assert not any("layer_norm_weight" in k for k in names)  # TE's fused norm names
    assert tuple(model.state_dict()["output_layer.weight"].shape) == (131, HIDDEN)


# --- the output folder -----------------------------------------------------------------------------
def test_overwrite_replaces_only_the_converters_entries_metadata_last(root, src, monkeypatch):
    out = root / "used"
    (out / "model").mkdir(parents=True)
    (out / "model" / "stale.distcp").write_text("old")
    (out / "config.json").write_text('{"the": "user\'s"}')
    (out / "tokenizer_config.json").write_text("old tokenizer")
    (out / model_io.META_NAME).write_text('{"old": true}')
    (out / "notes.txt").write_text("the user's")
    moves: list[tuple[str, bool]] = []  # (name moved into out, was an old metadata file there)
    real_replace = os.replace

    def spy(a, b):
        if Path(b).parent == out and not Path(b).name.startswith(".tmp"):
            moves.append((Path(b).name, (out / model_io.META_NAME).exists()))
        return real_replace(a, b)

    monkeypatch.setattr(os, "replace", spy)
    meta, _ = _convert(src, out, overwrite=True, progress=False)
    monkeypatch.undo()
    assert meta == _expected_meta(src, dtype="bf16", source_dtype="bf16")
    assert sorted(name for name, _ in moves) == sorted(["config.json", "model", model_io.META_NAME, *TOKENIZER])
    assert moves[-1][0] == model_io.META_NAME  # a folder with metadata is a complete checkpoint
    assert not any(had_meta for _, had_meta in moves)  # the old metadata went first
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", model_io.META_NAME, "model", "notes.txt",
                                                            *TOKENIZER])
    assert (out / "notes.txt").read_text() == "the user's"
    for name in ("config.json", *TOKENIZER):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "model" / "stale.distcp").exists()
    _assert_weights(out, src, torch.bfloat16)


def test_overwrite_replaces_a_symlinked_model_folder_not_its_target(root, src):
    # An --out whose model/ links to another disk (a common way to put weights on scratch): the link is
    # replaced by the new folder; what it pointed to is left alone.
    out, elsewhere = root / "linked", root / "scratch_model"
    elsewhere.mkdir()
    (elsewhere / "keep.distcp").write_text("someone else's")
    out.mkdir()
    (out / "model").symlink_to(elsewhere, target_is_directory=True)
    meta, _ = _convert(src, out, overwrite=True, progress=False)
    assert meta == _expected_meta(src, dtype="bf16", source_dtype="bf16")
    assert (out / "model").is_dir() and not (out / "model").is_symlink()
    assert [p.name for p in elsewhere.iterdir()] == ["keep.distcp"]
    _assert_weights(out, src, torch.bfloat16)


def test_non_empty_folder_is_refused_naming_five_entries(root, src):
    out = root / "full"
    out.mkdir()
    for name in ("f", "e", "d", "c", "b", "a"):
        (out / name).write_text(name)
    before = _listing(out)
    with pytest.raises(FileExistsError, match=re.escape(f"--out {str(out)!r} is not empty (holds ['a', 'b', 'c', "
                                                        "'d', 'e']); choose a new folder or pass --overwrite to "
                                                        "replace the checkpoint files in it")):
        C.convert_hf_to_megatron(src, out, progress=False)
    assert _listing(out) == before


def test_out_that_is_a_file_is_refused(root, src):
    out = root / "a_file"
    out.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=re.escape(f"--out {str(out)!r} exists and is not a folder")):
            C.convert_hf_to_megatron(src, out, overwrite=overwrite, progress=False)
    assert out.read_text() == "mine"


@pytest.mark.parametrize("where", ["equal", "inside"])
def test_out_in_the_source_is_refused_before_writing(root, src, where):
    out = src if where == "equal" else src / "sub" / "mc"
    what = "the source folder" if where == "equal" else "inside the source folder"
    before = _listing(src)
    with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} is {what} {str(src)!r}; choose a folder "
                                                   "outside it")):
        C.convert_hf_to_megatron(src, out, overwrite=True, progress=False)
    assert _listing(src) == before


def test_check_out_dir_resolves_paths(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    model_io.check_out_dir(tmp_path / "src", tmp_path / "out")
    model_io.check_out_dir(tmp_path / "src", tmp_path / "src2")  # a sibling with a common prefix is outside
    model_io.check_out_dir(tmp_path / "src" / "a", tmp_path / "src")  # the source's parent is outside it
    with pytest.raises(ValueError, match=r"^--ckpt '.*/src/a/\.\.' is the source folder '.*/src'; choose"):
        model_io.check_out_dir(tmp_path / "src", tmp_path / "src" / "a" / ".." / ".", flag="--ckpt")
    with pytest.raises(ValueError, match=r"^--out '.*/src/a/b' is inside the source folder '.*/src'; choose"):
        model_io.check_out_dir(tmp_path / "src" / ".", tmp_path / "src" / "a" / "b")


def test_failure_removes_a_new_folder_and_the_staging_folder(root, bad_shape_src):
    message = r"decoder\.layers\.0\.mlp\.linear_fc2\.weight: converted shard \(96, 64\) != parameter \(64, 96\)"
    new = root / "fail_new" / "mc"
    with pytest.raises(ValueError, match=message):
        C.convert_hf_to_megatron(bad_shape_src, new, progress=False)
    assert not new.exists()

    empty = root / "fail_empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=message):
        C.convert_hf_to_megatron(bad_shape_src, empty, progress=False)
    assert empty.is_dir() and not any(empty.iterdir())  # the user's folder stays

    used = root / "fail_used"
    (used / "model").mkdir(parents=True)
    (used / "model" / "old.distcp").write_text("old")
    (used / model_io.META_NAME).write_text('{"old": true}')
    (used / "notes.txt").write_text("the user's")
    before = _listing(used)
    with pytest.raises(ValueError, match=message):
        C.convert_hf_to_megatron(bad_shape_src, used, overwrite=True, progress=False)
    assert _listing(used) == before  # nothing replaced, no staging folder left


def test_cleanup_never_hides_the_error_that_stopped_the_conversion(root, src):
    """A stray *file* with the staging folder's name: the error is the one that stopped the conversion
    (the staging folder cannot be made), not one from removing the staging folder; the file stays."""
    out = root / "stray_staging"
    out.mkdir()
    stray = out / f".tmp-convert-{os.getpid()}"
    stray.write_text("not mine to delete")
    with pytest.raises(NotADirectoryError, match=re.escape(str(stray / model_io.MODEL_SUBDIR))):
        C.convert_hf_to_megatron(src, out, overwrite=True, progress=False)
    assert _listing(out) == {stray.name: b"not mine to delete"}


# --- bad input: a clear error before anything is written ------------------------------------------
def _edited_src(root: Path, name: str, edit) -> Path:
    return _hf_dir(root / name, tokenizer=False, edit=edit)


def test_missing_and_unexpected_tensors_are_named(root):
    out = root / "mc_bad_keys"
    missing = _edited_src(root, "src_missing", lambda t: {k: v for k, v in t.items()
                                                           if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=re.escape("1 tensors missing from the HF checkpoint for family 'qwen2', "
                                                   "e.g. ['model.layers.1.mlp.up_proj.weight']")):
        C.convert_hf_to_megatron(missing, out, progress=False)
    extra = _edited_src(root, "src_extra", lambda t: {**t, "model.layers.0.mlp.extra.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=re.escape("1 HF tensors have no rule in family 'qwen2' (they would be "
                                                   "lost), e.g. ['model.layers.0.mlp.extra.weight']")):
        C.convert_hf_to_megatron(extra, out, progress=False)
    assert not out.exists()


def test_parallel_sizes_that_do_not_fit_are_refused(root, src):
    out = root / "mc_tp3"
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        C.convert_hf_to_megatron(src, out, tp=3, progress=False)
    with pytest.raises(ValueError, match="pp=3 does not divide num_hidden_layers=2"):
        C.convert_hf_to_megatron(src, out, pp=3, progress=False)
    assert not out.exists()


def test_unsupported_architecture_is_refused(root):
    src = root / "src_gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        C.convert_hf_to_megatron(src, root / "mc_gpt2", progress=False)
    assert not (root / "mc_gpt2").exists()


def test_load_hf_config_reads_a_config(src):
    cfg = model_io.load_hf_config(str(src))
    assert (cfg.model_type, cfg.architectures, cfg.num_hidden_layers, cfg.vocab_size) == (
        "qwen2", ["Qwen2ForCausalLM"], LAYERS, VOCAB)


NOT_A_CONFIG = re.escape("is not a Hugging Face model config (a JSON object with 'model_type')") + "$"
BAD_CONFIGS = {
    "not json": (b'{"model_type": "qw', r"is not valid JSON \(Unterminated string"),
    "not utf-8": (b'{"model_type": "\xff\xfe"}', r"is not valid JSON \('utf-8' codec can't decode"),
    "a list": (b'[{"model_type": "qwen2"}]', NOT_A_CONFIG),
    "no model_type": (b'{"hidden_size": 8}', NOT_A_CONFIG),
    "model_type not a string": (b'{"model_type": 5}', NOT_A_CONFIG),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_json_is_named(tmp_path, case):
    raw, message = BAD_CONFIGS[case]
    (tmp_path / "config.json").write_bytes(raw)
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointFormatError, match=f"^{re.escape(repr(str(path)))} {message}") as info:
        model_io.load_hf_config(tmp_path)
    assert info.value.path == str(path)
    with pytest.raises(CheckpointFormatError, match=message):
        C.convert_hf_to_megatron(tmp_path, tmp_path.parent / f"{tmp_path.name}_out", progress=False)
    assert not (tmp_path.parent / f"{tmp_path.name}_out").exists()


def test_missing_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(f"no config.json in {str(tmp_path)!r}")):
        model_io.load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no config.json in {str(tmp_path)!r}")):
        C.convert_hf_to_megatron(tmp_path, tmp_path / "out", progress=False)


def test_a_conversion_starts_no_process_and_leaves_megatrons_results_queue_as_it_was(root, src):
    # The shard files are written in this process: megatron's default results queue (a spawn Manager, a
    # server process per saving process) is swapped for a thread queue for the save, then put back.
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before_queue, before_children = filesystem_async._results_queue, set(multiprocessing.active_children())
    meta, _ = _convert(src, root / "no_manager", progress=False)
    assert meta == _expected_meta(src, dtype="bf16", source_dtype="bf16")
    assert set(multiprocessing.active_children()) == before_children
    assert filesystem_async._results_queue is before_queue
    _assert_weights(root / "no_manager", src, torch.bfloat16)
