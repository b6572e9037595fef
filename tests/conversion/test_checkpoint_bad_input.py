"""Bad input at the checkpoint surfaces: HF safetensors folders, dist checkpoints, converter outputs.

Every case is a file a user could plausibly hand us (truncated, random, hand-edited, crafted) and the
test asserts the exact outcome: a ``CheckpointFormatError`` naming the file, the user's files still
there, no code run, no temporary files left. One tiny checkpoint is converted once in a subprocess
(saving a dist checkpoint starts a multiprocessing Manager, see ``tests/conversion/test_checkpoint_files.py``); the
cases that need a model load run there too, the others run here on copies of it.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from megatron_credit.conversion.hf_io import (INDEX_NAME, SINGLE_NAME, CheckpointFormatError, SafetensorsReader,
                                              ShardedSafetensorsWriter, write_safetensors)

from tests.support.paths import REPO
from tests.support.payloads import RunsCode


# --- safetensors files and indexes --------------------------------------------------------------------
def _single(folder: Path, blob: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SINGLE_NAME).write_bytes(blob)
    return folder / SINGLE_NAME


def _valid_blob() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(24)


def _with_header(header: object, data: bytes = bytes(24)) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


SAFETENSORS_CASES = {
    "shorter than 8 bytes": (b"\x01\x02\x03", "too short for a safetensors file"),
    "random bytes": (bytes(range(7, 250)) * 4, "header length .* is larger than the file"),
    "header length past the end": (struct.pack("<Q", 10**6) + b"{}", "header length 1000000 is larger than the file"),
    "json cut mid-header": (struct.pack("<Q", 42) + b'{"w": {"dtype": "F32", "shape": [2, 3], "da', "not valid JSON"),
    "file cut mid-header": (_valid_blob()[:40], "header length .* is larger than the file"),
    "header is a list": (_with_header([1, 2]), "header is a JSON list, not an object"),
    "entry without offsets": (_with_header({"w": {"dtype": "F32", "shape": [2, 3]}}), "tensor 'w': header entry"),
    "unknown dtype": (_with_header({"w": {"dtype": "Q7", "shape": [6], "data_offsets": [0, 24]}}),
                      "unsupported dtype 'Q7'"),
    "shape disagrees with data": (_with_header({"w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 24]}}),
                                  r"shape \[4, 3\] x F32 needs 48 bytes, data_offsets span 24"),
    "negative dimension": (_with_header({"w": {"dtype": "F32", "shape": [-1, 6], "data_offsets": [0, 24]}}),
                           "is not a list of non-negative integers"),
    "data truncated": (_valid_blob()[:-4], "data ends at byte 24 past the end of the data"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_corrupt_safetensors_file_is_named(tmp_path, case):
    blob, message = SAFETENSORS_CASES[case]
    path = _single(tmp_path, blob)
    with pytest.raises(CheckpointFormatError, match=message) as info:
        SafetensorsReader(tmp_path)
    assert str(path) in str(info.value) and info.value.path == str(path)


def _sharded(folder: Path) -> None:
    w = ShardedSafetensorsWriter(folder, max_shard_bytes=16)
    w.add("a", torch.arange(4.0))
    w.add("b", torch.ones(4))
    assert w.close() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


INDEX_CASES = {
    "not json": (b'{"weight_map": {"a": "model-00001-of', "is not valid JSON"),
    "a list": (b"[1, 2]", "expected an object with a 'weight_map' object"),
    "no weight_map": (b'{"metadata": {}}', "expected an object with a 'weight_map' object"),
    "path outside the folder": (json.dumps({"weight_map": {"a": "../../etc/passwd.safetensors"}}).encode(),
                                "maps tensor 'a' to '../../etc/passwd.safetensors'"),
    "not a safetensors file": (json.dumps({"weight_map": {"a": "config.json"}}).encode(), "maps tensor 'a'"),
    "lists a tensor the shard lacks": (
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                                   "c": "model-00002-of-00002.safetensors"}}).encode(),
        r"lists 1 tensor\(s\) for 'model-00002-of-00002.safetensors' that it does not store, e.g. \['c'\]"),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_corrupt_index_is_named(tmp_path, case):
    _sharded(tmp_path)
    raw, message = INDEX_CASES[case]
    (tmp_path / INDEX_NAME).write_bytes(raw)
    with pytest.raises(CheckpointFormatError, match=message) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(tmp_path / INDEX_NAME)


def test_valid_files_still_read(tmp_path):
    _single(tmp_path / "one", _valid_blob())
    assert torch.equal(SafetensorsReader(tmp_path / "one").get("w"), torch.zeros(2, 3))
    _sharded(tmp_path / "two")
    assert torch.equal(SafetensorsReader(tmp_path / "two").get("a"), torch.arange(4.0))


# --- the exporter never deletes files it did not write -------------------------------------------------
USER_FILES = ("model_ema.safetensors", "model-finetuned-v2.safetensors", "model-00009-of-00009.safetensors",
              "adapter_model.safetensors", "notes.txt")


@pytest.mark.parametrize("earlier", ["none", "single", "sharded", "corrupt index"])
@pytest.mark.parametrize("now_sharded", [False, True])
def test_export_removes_only_its_own_earlier_files(tmp_path, earlier, now_sharded):
    for name in USER_FILES:
        (tmp_path / name).write_text("the user's")
    if earlier == "single":
        _single(tmp_path, _valid_blob())
    elif earlier == "sharded":
        _sharded(tmp_path)
    elif earlier == "corrupt index":
        (tmp_path / INDEX_NAME).write_text("{not json")
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=16 if now_sharded else 10**9)
    w.add("x", torch.ones(4))
    w.add("y", torch.zeros(4))
    files = w.close()
    present = sorted(p.name for p in tmp_path.iterdir())
    assert sorted(set(present) - set(USER_FILES)) == sorted(files + ([INDEX_NAME] if now_sharded else []))
    for name in USER_FILES:
        assert (tmp_path / name).read_text() == "the user's", name
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.keys()) == ["x", "y"] and torch.equal(reader.get("x"), torch.ones(4))


def test_failed_export_leaves_no_temporary_or_half_written_file(tmp_path):
    _single(tmp_path, _valid_blob())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=16)
    w.add("x", torch.ones(4))
    w.add("y", torch.ones(4))  # flushes the first shard to a temporary file
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    w.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    with pytest.raises(NotImplementedError):  # the meta tensor has no data: fails after "a" was written
        write_safetensors(tmp_path / "half.safetensors", {"a": torch.ones(2), "b": torch.empty(4, device="meta")})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)


# --- dist checkpoints and the converters ----------------------------------------------------------------
def _step(results: dict, name: str, fn) -> None:
    try:
        results[name] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001  (recorded for the test that owns the step)
        results[name] = {"ok": False, "type": type(e).__name__, "error": str(e), "trace": traceback.format_exc()}


def _extra_state_item(ckpt: Path) -> tuple[Path, int, int]:
    """(data file, offset, length) of one byte item (a linear layer's ``_extra_state``) of ``ckpt``."""
    from megatron_credit.conversion.safe_load import read_dist_metadata

    md = read_dist_metadata(ckpt / "model")
    for index, info in md.storage_data.items():
        if index.fqn.endswith("_extra_state/shard_0_2"):
            return ckpt / "model" / info.relative_path, info.offset, info.length
    raise AssertionError("no _extra_state byte item")


def _produce(root: str) -> None:
    """The tiny checkpoint, and the cases that need a conversion or a model load (a fresh process)."""
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion import converters as C
    from megatron_credit.conversion.testing import tiny_hf_config
    from megatron_credit.commands import convert_hf_to_megatron as to_mc

    root = Path(root)
    results: dict = {}
    torch.manual_seed(0)
    src = root / "src"
    AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", vocab_size=64, num_hidden_layers=2),
                                     dtype=torch.float32).save_pretrained(src)
    _step(results, "convert", lambda: C.convert_hf_to_megatron(src, root / "mc", progress=False))

    # --overwrite into a folder with a user's files (and an earlier checkpoint's model/).
    used = root / "used"
    (used / "model").mkdir(parents=True)
    (used / "model" / "stale.distcp").write_text("old")
    (used / "config.json").write_text('{"the": "user\'s"}')
    (used / "notes.txt").write_text("the user's")
    _step(results, "overwrite", lambda: to_mc.main(["--hf-dir", str(src), "--out", str(used), "--overwrite",
                                                   "--no-progress"]))

    # A failure while saving leaves nothing behind.
    def failing_save():
        def boom():
            raise RuntimeError("disk full")
        original, C._save_strategy = C._save_strategy, boom
        try:
            C.convert_hf_to_megatron(src, root / "failed", progress=False)
        finally:
            C._save_strategy = original

    _step(results, "failed_save", failing_save)
    results["failed_save_left"] = sorted(str(p.relative_to(root)) for p in root.glob("failed*"))

    # A byte item that runs code when torch.load(weights_only=False) reads it.
    evil = root / "evil_bytes"
    shutil.copytree(root / "mc", evil)
    path, offset, length = _extra_state_item(evil)
    payload = pickle.dumps(RunsCode(root / "pwned_bytes"), protocol=2)
    assert len(payload) <= length
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload + bytes(length - len(payload)))
    _step(results, "evil_bytes", lambda: C.convert_megatron_to_hf(evil, root / "evil_out", progress=False))
    results["pwned_bytes"] = (root / "pwned_bytes").exists()
    _step(results, "clean_export", lambda: C.convert_megatron_to_hf(root / "mc", root / "back", progress=False))
    (root / "results.json").write_text(json.dumps(results, indent=1, default=str))


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    code = f"from tests.conversion.test_checkpoint_bad_input import _produce; _produce({str(root)!r})"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((root / "results.json").read_text())
    assert results["convert"]["ok"], results["convert"]["trace"]
    return root, results


@pytest.fixture
def ckpt(produced, tmp_path):
    """A private copy of the good tiny checkpoint."""
    shutil.copytree(produced[0] / "mc", tmp_path / "mc")
    return tmp_path / "mc"


def _to_hf(ckpt: Path, out: Path):
    from megatron_credit.conversion.converters import convert_megatron_to_hf

    return convert_megatron_to_hf(ckpt, out, progress=False)


@pytest.mark.spawn
def test_crafted_metadata_pickle_is_refused_without_running_code(ckpt, tmp_path):
    from megatron_credit.conversion.safe_load import UnsafeCheckpointError

    marker = tmp_path / "pwned"
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"references posix\.system.*refusing to unpickle"):
        _to_hf(ckpt, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.spawn
def test_crafted_byte_item_is_refused_without_running_code(produced):
    root, results = produced
    r = results["evil_bytes"]
    assert not r["ok"] and r["type"] == "UnsafeCheckpointError", r
    assert "_extra_state" in r["error"] and "weights_only=True" in r["error"], r
    assert results["pwned_bytes"] is False
    assert not list((root / "evil_out").glob("*.safetensors")) if (root / "evil_out").exists() else True


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


DIST_CASES = {
    "deleted distcp": (lambda c: (c / "model" / "__0_0.distcp").unlink(), "__0_0.distcp' is missing"),
    "truncated distcp": (lambda c: _truncate(c / "model" / "__0_0.distcp"), "__0_0.distcp'.* truncated"),
    "deleted common state": (lambda c: _drop_common_state(c / "model"),
                             "common.pt' is missing, and .metadata names no 'common_state/shard_0_1' item"),
    "deleted .metadata": (lambda c: (c / "model" / ".metadata").unlink(), ".metadata' is missing"),
    "truncated .metadata": (lambda c: _truncate(c / "model" / ".metadata"), ".metadata' cannot be read"),
    "random .metadata": (lambda c: (c / "model" / ".metadata").write_bytes(bytes(range(256))),
                         ".metadata' cannot be read"),
    "bad megatron metadata.json": (lambda c: (c / "model" / "metadata.json").write_text("[1"), "is not valid JSON"),
    "deleted model/": (lambda c: shutil.rmtree(c / "model"), "no dist checkpoint at"),
}


def _drop_common_state(model: Path) -> None:
    """Delete the common state in either format: common.pt (megatron-core 0.16) or 0.19's .distcp item."""
    from megatron_credit.conversion.safe_load import COMMON_STATE_KEY, read_dist_metadata

    if (model / "common.pt").exists():
        (model / "common.pt").unlink()
    md = read_dist_metadata(model)
    for index in [i for i in md.storage_data if i.fqn == COMMON_STATE_KEY]:
        del md.state_dict_metadata[COMMON_STATE_KEY], md.storage_data[index]
        (model / ".metadata").write_bytes(pickle.dumps(md))


FORMATS = ["0.16", "0.19"]  # megatron-core 0.16's common.pt, 0.19's common state inside __0_0.distcp


def _in_format(ckpt: Path, fmt: str) -> Path:
    from megatron_credit.conversion.testing import rewrite_common_state

    rewrite_common_state(ckpt / "model", fmt)
    return ckpt


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", sorted(DIST_CASES))
@pytest.mark.spawn
def test_damaged_dist_checkpoint_gets_one_clear_error(ckpt, tmp_path, case, fmt):
    damage, message = DIST_CASES[case]
    damage(_in_format(ckpt, fmt))
    with pytest.raises((CheckpointFormatError, FileNotFoundError), match=message):
        _to_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _edit_meta(ckpt: Path, fn) -> None:
    path = ckpt / "conversion_meta.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


META_CASES = {
    "claims bf16 for fp32 data": (lambda m: {**m, "dtype": "bf16"},
                                  r"says dtype 'bf16' \(torch.bfloat16\) but model/ stores \['torch.float32'\] weights"),
    "unknown dtype": (lambda m: {**m, "dtype": "fp8"}, r"dtype 'fp8' is not one of \['bf16', 'fp16', 'fp32'\]"),
    "missing dtype": (lambda m: {k: v for k, v in m.items() if k != "dtype"}, "has no 'dtype'"),
    "a list": (lambda m: [m], "is a JSON list, expected an object"),
    "other version": (lambda m: {**m, "conversion_version": 99}, "conversion_version 99 != 1"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
@pytest.mark.spawn
def test_conversion_meta_is_checked(ckpt, tmp_path, case):
    edit, message = META_CASES[case]
    _edit_meta(ckpt, edit)
    with pytest.raises(CheckpointFormatError, match=message) as info:
        _to_hf(ckpt, tmp_path / "out")
    assert "conversion_meta.json" in str(info.value)


@pytest.mark.spawn
def test_conversion_meta_not_json(ckpt, tmp_path):
    (ckpt / "conversion_meta.json").write_text('{"dtype": "fp')
    with pytest.raises(CheckpointFormatError, match="conversion_meta.json' is not valid JSON"):
        _to_hf(ckpt, tmp_path / "out")


@pytest.mark.parametrize("where", ["equal", "inside"])
@pytest.mark.spawn
def test_export_into_the_source_is_refused_before_writing(ckpt, where):
    out = ckpt if where == "equal" else ckpt / "model" / "hf"
    before = sorted(str(p) for p in ckpt.rglob("*"))
    with pytest.raises(ValueError, match="source folder"):
        _to_hf(ckpt, out)
    assert sorted(str(p) for p in ckpt.rglob("*")) == before


@pytest.mark.spawn
def test_clean_export_still_works(produced):
    root, results = produced
    assert results["clean_export"]["ok"], results["clean_export"]["trace"]
    assert results["clean_export"]["value"] == ["model.safetensors"]
    assert sorted(SafetensorsReader(root / "back").keys()) == sorted(SafetensorsReader(root / "src").keys())


# --- HF -> megatron: the output folder -----------------------------------------------------------------
def _to_mc(src: Path, out: Path, **kw):
    from megatron_credit.conversion.converters import convert_hf_to_megatron

    return convert_hf_to_megatron(src, out, progress=False, **kw)


@pytest.mark.spawn
def test_import_refuses_a_non_empty_folder(produced, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("the user's")
    with pytest.raises(FileExistsError, match=r"is not empty \(holds \['config.json'\]\).*--overwrite"):
        _to_mc(produced[0] / "src", out)
    assert (out / "config.json").read_text() == "the user's" and sorted(os.listdir(out)) == ["config.json"]


@pytest.mark.parametrize("where", ["equal", "inside"])
@pytest.mark.spawn
def test_import_into_the_source_is_refused_before_writing(produced, tmp_path, where):
    src = tmp_path / "src"
    shutil.copytree(produced[0] / "src", src)
    before = sorted(os.listdir(src))
    with pytest.raises(ValueError, match="source folder"):
        _to_mc(src, src if where == "equal" else src / "mc", overwrite=True)
    assert sorted(os.listdir(src)) == before


@pytest.mark.spawn
def test_import_overwrite_replaces_only_its_files(produced):
    root, results = produced
    assert results["overwrite"] == {"ok": True, "value": 0}, results["overwrite"]
    used = root / "used"
    assert (used / "notes.txt").read_text() == "the user's"
    assert (used / "config.json").read_bytes() == (root / "src" / "config.json").read_bytes()
    assert not (used / "model" / "stale.distcp").exists() and (used / "model" / ".metadata").is_file()
    assert not [p for p in used.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.spawn
def test_failed_import_leaves_nothing(produced):
    _, results = produced
    r = results["failed_save"]
    assert not r["ok"] and r["error"] == "disk full", r
    assert results["failed_save_left"] == []


# --- the command line ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.spawn
def test_converter_cli_prints_one_line_and_exits_2(ckpt, tmp_path, capsys, fmt):
    from megatron_credit.commands import convert_megatron_to_hf as to_hf

    _drop_common_state(_in_format(ckpt, fmt) / "model")
    assert to_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "common.pt' is missing, and .metadata names no " \
        "'common_state/shard_0_1' item" in err, err
    with pytest.raises(CheckpointFormatError, match="common.pt' is missing"):
        to_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out"), "--no-progress", "--debug"])
    assert not (tmp_path / "out").exists()


@pytest.mark.spawn
def test_crafted_common_state_pickle_is_one_line_and_runs_nothing(ckpt, tmp_path, capsys):
    """megatron-core 0.19's common_state/shard_0_1 byte item replaced by a pickle that runs code (torch's
    load planner would unpickle it with weights_only=False): the converter prints one line naming the
    file and the item, and exits 2; nothing ran, nothing was written."""
    from megatron_credit.conversion.safe_load import COMMON_STATE_KEY, read_dist_metadata
    from megatron_credit.commands import convert_megatron_to_hf as to_hf

    model = _in_format(ckpt, "0.19") / "model"
    md = read_dist_metadata(model)
    index = next(i for i in md.storage_data if i.fqn == COMMON_STATE_KEY)
    marker = tmp_path / "pwned"
    payload = pickle.dumps([RunsCode(marker)], protocol=2)  # a plain pickle: torch.load(weights_only=False) runs it
    info = md.storage_data[index]
    with open(model / info.relative_path, "ab") as f:
        md.storage_data[index] = type(info)(relative_path=info.relative_path, offset=f.tell(), length=len(payload))
        f.write(payload)
    (model / ".metadata").write_bytes(pickle.dumps(md))
    assert to_hf.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {str(model / '__0_0.distcp')!r} byte item "
                                                   "'common_state/shard_0_1' does not load with weights_only=True ("), err
    assert err.rstrip().endswith("); refusing it"), err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_cli_keeps_the_traceback_of_internal_errors(capsys):
    from megatron_credit.cli import run_main

    def main(argv):
        raise AssertionError("internal invariant")

    with pytest.raises(AssertionError, match="internal invariant"):
        run_main(main, [])
    assert run_main(lambda argv: None, ["--debug"]) == 0 and capsys.readouterr().err == ""


def test_cli_filters_known_harmless_warnings_only():
    import warnings

    from megatron_credit.cli import run_main

    shown: list[list[str]] = []

    def main(argv):
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
            warnings.warn("Apex is not installed. Falling back to Torch Norm")
            warnings.warn("something the user should read")
        shown.append([str(w.message) for w in seen])
        return 0

    with warnings.catch_warnings():  # run_main changes the process's filters; keep pytest's
        assert run_main(main, []) == 0
    with warnings.catch_warnings():
        assert run_main(main, ["--debug"]) == 0
    assert shown[0] == ["something the user should read"]
    assert shown[1][0].startswith("Transformer Engine") and shown[1][-1] == "something the user should read"
