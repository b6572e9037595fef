"""``conversion/hf_io.py`` in-process: what a user of an HF checkpoint folder relies on, exactly.

- The reader: a single ``model.safetensors`` or an index plus shards, every stored dtype read back
  bit for bit (zero-size tensors too), ``dtypes``, ``total_bytes``; each malformed file or index refused
  with a ``CheckpointFormatError`` whose path is the file and whose message says what is wrong (the
  messages are checked whole: they are what the user reads).
- The writer: byte-exact safetensors files (compact JSON header padded to 8 bytes, ``format: pt`` as
  transformers expects), shard boundaries at ``max_shard_bytes`` (a tensor that fills a shard exactly
  stays in it), ``save_pretrained``'s file names and index text, an earlier export's weight files
  removed but nothing else, and ``abort`` leaving the folder as it was.
- Atomic writes and copies, tokenizer file copying, ``CheckpointFormatError`` pickling, and the dtype
  rules of ``resolve_dtype`` with their messages.
"""
from __future__ import annotations

import json
import pickle
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_credit.conversion import hf_io
from megatron_credit.conversion.hf_io import (INDEX_NAME, SINGLE_NAME, TOKENIZER_FILES, CheckpointFormatError,
                                              SafetensorsReader, ShardedSafetensorsWriter, copy_file_atomic,
                                              copy_tokenizer_files, resolve_dtype, write_safetensors,
                                              write_text_atomic)


def _raw(path: Path, header: object | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file in the safetensors format with any header (JSON-encoded unless bytes) and data bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _shard_contents(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of one file, read by the safetensors library (what transformers uses)."""
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


# --- CheckpointFormatError -------------------------------------------------------------------------------
def test_checkpoint_format_error_names_the_file_and_survives_pickling(tmp_path):
    err = CheckpointFormatError(tmp_path / "model.safetensors", "is truncated (tensor 'w')")
    assert isinstance(err, ValueError)
    assert str(err) == f"'{tmp_path}/model.safetensors' is truncated (tensor 'w')"
    assert err.path == f"{tmp_path}/model.safetensors" and isinstance(err.path, str)
    assert err.why == "is truncated (tensor 'w')"
    # torch's checkpoint reader hands exceptions between threads by pickling them
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CheckpointFormatError
    assert (str(back), back.path, back.why) == (str(err), err.path, err.why)


# --- write_safetensors: the exact bytes of the format -------------------------------------------------
def test_write_safetensors_writes_the_exact_format(tmp_path):
    tensors = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([[1, -2, 3]], dtype=torch.int16)}
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    header = (b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
              b'"b":{"dtype":"I16","shape":[1,3],"data_offsets":[8,14]}}')
    assert len(header) == 141
    padded = header + b"   "  # spaces up to a multiple of 8
    want = struct.pack("<Q", 144) + padded + struct.pack("<2f", 1.0, -2.0) + struct.pack("<3h", 1, -2, 3)
    assert (tmp_path / "x.safetensors").read_bytes() == want
    assert _listing(tmp_path) == ["x.safetensors"]  # no temporary file left
    metadata, back = _shard_contents(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"}
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_write_safetensors_without_metadata_has_no_metadata_entry(tmp_path):
    write_safetensors(tmp_path / "y.safetensors", {"c": torch.tensor([7], dtype=torch.uint8)})
    header = b'{"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert len(header) == 53
    assert (tmp_path / "y.safetensors").read_bytes() == struct.pack("<Q", 56) + header + b"   " + b"\x07"
    (tmp_path / "y.safetensors").rename(tmp_path / SINGLE_NAME)
    reader = SafetensorsReader(tmp_path)
    assert reader.keys() == ["c"] and torch.equal(reader.get("c"), torch.tensor([7], dtype=torch.uint8))


# --- the reader ----------------------------------------------------------------------------------------
def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    r = torch.randn(2, 3, generator=g, dtype=torch.float64)
    return {"bf16": (r * 3).to(torch.bfloat16), "f16": (r * 5).to(torch.float16), "f32": (r * 7).float(),
            "f64": r * 11, "i64": torch.tensor([-(2**40), 3, 2**50]), "i32": torch.tensor([[-7, 2**30]], dtype=torch.int32),
            "i16": torch.tensor([-300, 301], dtype=torch.int16), "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 200, 255], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
            "t": (r * 13).float().t()}  # non-contiguous


def test_reader_reads_a_single_file_of_every_dtype(tmp_path):
    tensors = _every_dtype()
    write_safetensors(tmp_path / SINGLE_NAME, tensors, metadata={"format": "pt"})
    reader = SafetensorsReader(tmp_path)
    assert reader.keys() == list(tensors)
    for k, v in tensors.items():
        got = reader.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    assert reader.dtypes() == {torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
    assert reader.dtypes(["bf16", "i8"]) == {torch.bfloat16, torch.int8}
    assert reader.dtypes(["f32", "t"]) == {torch.float32}
    assert reader.total_bytes() == (tmp_path / SINGLE_NAME).stat().st_size


def test_reader_reads_zero_size_tensors_and_files_without_data(tmp_path):
    write_safetensors(tmp_path / SINGLE_NAME, {"empty": torch.zeros(0, 4, dtype=torch.bfloat16)})
    raw = (tmp_path / SINGLE_NAME).read_bytes()
    assert struct.unpack("<Q", raw[:8])[0] == len(raw) - 8  # the header runs to the end of the file
    reader = SafetensorsReader(tmp_path)
    got = reader.get("empty")
    assert got.dtype == torch.bfloat16 and got.shape == (0, 4)
    # a zero-size tensor between two others: offsets [8, 8]
    tensors = {"a": torch.tensor([1.5, 2.5]), "e": torch.zeros(3, 0, dtype=torch.int64), "b": torch.tensor([4.0])}
    (tmp_path / "two").mkdir()
    write_safetensors(tmp_path / "two" / SINGLE_NAME, tensors)
    raw = (tmp_path / "two" / SINGLE_NAME).read_bytes()
    assert json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["e"]["data_offsets"] == [8, 8]
    reader = SafetensorsReader(tmp_path / "two")
    for k, v in tensors.items():
        got = reader.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


def _write_sharded(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    w = ShardedSafetensorsWriter(folder, max_shard_bytes=max_shard_bytes)
    for k, v in tensors.items():
        w.add(k, v)
    return w.close()


def test_reader_reads_an_index_and_its_shards(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.arange(4, 8, dtype=torch.int32),
               "c": torch.arange(8.0, 12.0).to(torch.bfloat16), "d": torch.tensor([True, False])}
    files = _write_sharded(tmp_path, tensors, max_shard_bytes=16)
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.keys()) == ["a", "b", "c", "d"]
    assert reader.weight_map == {"a": files[0], "b": files[1], "c": files[2], "d": files[2]}
    for k, v in tensors.items():
        assert torch.equal(reader.get(k), v) and reader.get(k).dtype == v.dtype, k
    assert reader.dtypes() == {torch.float32, torch.int32, torch.bfloat16, torch.bool}
    assert reader.dtypes(["c", "d"]) == {torch.bfloat16, torch.bool}
    # each shard counted once, though the last one holds two tensors
    assert reader.total_bytes() == sum((tmp_path / f).stat().st_size for f in files)


def test_reader_refuses_missing_folders_and_files(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        SafetensorsReader(tmp_path / "nope")
    assert str(info.value) == f"HF checkpoint folder '{tmp_path}/nope' does not exist"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as info:
        SafetensorsReader(tmp_path)
    assert str(info.value) == (f"no model.safetensors or model.safetensors.index.json in '{tmp_path}' "
                               "(found ['config.json', 'pytorch_model.bin']); only safetensors checkpoints are "
                               "supported")


def test_reader_refuses_a_folder_with_both_a_single_file_and_an_index(tmp_path):
    _write_sharded(tmp_path, {"a": torch.ones(4), "b": torch.ones(4)}, max_shard_bytes=16)
    write_safetensors(tmp_path / SINGLE_NAME, {"a": torch.ones(4)})
    with pytest.raises(ValueError) as info:
        SafetensorsReader(tmp_path)
    assert str(info.value) == (f"'{tmp_path}' holds both model.safetensors and model.safetensors.index.json "
                               "(two saves into one folder?); remove the stale one")


def test_reader_refuses_an_index_naming_a_missing_shard(tmp_path):
    _write_sharded(tmp_path, {"a": torch.ones(4), "b": torch.ones(4)}, max_shard_bytes=16)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as info:
        SafetensorsReader(tmp_path)
    assert str(info.value) == (f"shard 'model-00002-of-00002.safetensors' listed in model.safetensors.index.json "
                               f"is missing from '{tmp_path}'")


def test_reader_refuses_an_index_listing_tensors_a_shard_lacks(tmp_path):
    write_safetensors(tmp_path / "x.safetensors", {"w": torch.ones(2)})
    write_safetensors(tmp_path / "y.safetensors", {"v": torch.ones(2)})
    weight_map = {"w": "x.safetensors", "v": "y.safetensors", **{k: "y.safetensors" for k in "dcba"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(tmp_path / INDEX_NAME)
    # four missing, the first three (sorted) named
    assert str(info.value) == (f"'{tmp_path}/{INDEX_NAME}' lists 4 tensor(s) for 'y.safetensors' that it does not "
                               "store, e.g. ['a', 'b', 'c']")


def test_reader_get_of_an_unknown_name_and_of_a_file_truncated_since(tmp_path):
    write_safetensors(tmp_path / SINGLE_NAME, {"a": torch.arange(4.0), "b": torch.arange(8.0)})
    reader = SafetensorsReader(tmp_path)
    with pytest.raises(KeyError) as info:
        reader.get("c")
    assert info.value.args == (f"tensor 'c' is not in the checkpoint at '{tmp_path}'",)
    with pytest.raises(KeyError) as info:
        reader.dtypes(["a", "c"])
    assert info.value.args == (f"tensor 'c' is not in the checkpoint at '{tmp_path}'",)
    # another process rewrites the file under the open reader: the read comes up short
    path = tmp_path / SINGLE_NAME
    path.write_bytes(path.read_bytes()[:-4])
    assert torch.equal(reader.get("a"), torch.arange(4.0))
    with pytest.raises(CheckpointFormatError) as info:
        reader.get("b")
    assert info.value.path == str(path)
    assert str(info.value) == f"'{path}' is truncated (tensor 'b')"


# header entries a hand-edited or crafted file could hold: (entry, data bytes, why)
BAD_ENTRIES = {
    "entry without offsets": ({"dtype": "F32", "shape": [1]}, 4,
                              "header entry {'dtype': 'F32', 'shape': [1]} is not {dtype, shape, data_offsets}"),
    "entry not an object": ([1, 2], 4, "header entry [1, 2] is not {dtype, shape, data_offsets}"),
    "unknown dtype": ({"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}, 4, "unsupported dtype 'F8_E4M3'"),
    "negative dimension": ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}, 8,
                           "shape [2, -1] is not a list of non-negative integers"),
    "boolean dimension": ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, 8,
                          "shape [True, 2] is not a list of non-negative integers"),
    "float dimension": ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, 8,
                        "shape [2.0] is not a list of non-negative integers"),
    "shape not a list": ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, 8,
                         "shape '2' is not a list of non-negative integers"),
    "offsets reversed": ({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}, 8,
                         "data_offsets [8, 4] is not [begin, end]"),
    "offsets negative": ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, 8,
                         "data_offsets [-4, 0] is not [begin, end]"),
    "offsets floats": ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}, 8,
                       "data_offsets [0.0, 4.0] is not [begin, end]"),
    "three offsets": ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, 8,
                      "data_offsets [0, 4, 8] is not [begin, end]"),
    "offsets not a list": ({"dtype": "F32", "shape": [1], "data_offsets": "0:4"}, 8,
                           "data_offsets '0:4' is not [begin, end]"),
    "span disagrees with shape": ({"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 28]}, 32,
                                  "header shape [2, 3] x F32 needs 24 bytes, data_offsets span 20"),
    "data truncated": ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, 8,
                       "data ends at byte 16 past the end of the data (8 bytes): truncated"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_reader_refuses_a_bad_header_entry(tmp_path, case):
    entry, nbytes, why = BAD_ENTRIES[case]
    path = _raw(tmp_path / SINGLE_NAME, {"__metadata__": {"format": "pt"}, "w": entry}, bytes(nbytes))
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(path)
    assert str(info.value) == f"'{path}' tensor 'w': {why}"


def test_reader_refuses_bad_files(tmp_path):
    def refused(blob: bytes) -> str:
        path = tmp_path / SINGLE_NAME
        path.write_bytes(blob)
        with pytest.raises(CheckpointFormatError) as info:
            SafetensorsReader(tmp_path)
        assert info.value.path == str(path)
        return str(info.value)

    p = f"'{tmp_path}/{SINGLE_NAME}'"
    assert refused(b"\x01\x02\x03\x04\x05") == (f"{p} is 5 bytes, too short for a safetensors file "
                                                "(8-byte header length + JSON header)")
    # a length with the top bit set is a huge unsigned number, not a negative one
    assert refused(b"\xff" * 8 + b"{}") == (f"{p} header length 18446744073709551615 is larger than the file "
                                            "(10 bytes): truncated or not a safetensors file")
    # one byte more than the file holds
    assert refused(struct.pack("<Q", 8) + b'{"a":1}') == (f"{p} header length 8 is larger than the file (15 bytes): "
                                                          "truncated or not a safetensors file")
    why = refused(struct.pack("<Q", 8) + b'{"w": 1 ')
    assert re.fullmatch(re.escape(f"{p} header is not valid JSON (") + r"Expecting .+"
                        + re.escape("): truncated or not a safetensors file"), why), why
    why = refused(struct.pack("<Q", 4) + b"\xff\xfe\x00\x01")
    assert why.startswith(f"{p} header is not valid JSON (") and why.endswith("): truncated or not a safetensors file")
    assert refused(struct.pack("<Q", 6) + b"[1, 2]") == f"{p} header is a JSON list, not an object"
    assert refused(struct.pack("<Q", 2) + b"17") == f"{p} header is a JSON int, not an object"


def test_reader_header_length_cap(tmp_path, monkeypatch):
    """A header of exactly the cap is read; one past it is refused before it is read (the real cap is
    safetensors' 100 MB; a small one here keeps the files small)."""
    assert hf_io.MAX_HEADER_BYTES == 100 * 1000 * 1000
    monkeypatch.setattr(hf_io, "MAX_HEADER_BYTES", 64)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    _raw(tmp_path / "ok" / SINGLE_NAME, header.ljust(64), struct.pack("<f", 2.5))
    assert torch.equal(SafetensorsReader(tmp_path / "ok").get("w"), torch.tensor([2.5]))
    path = _raw(tmp_path / "big" / SINGLE_NAME, header.ljust(72), struct.pack("<f", 2.5) + bytes(100))
    with pytest.raises(CheckpointFormatError, match=r"^'.*' header length 72 is over the 64-byte limit of "
                                                    r"safetensors headers: not a safetensors file$") as info:
        SafetensorsReader(tmp_path / "big")
    assert info.value.path == str(path)


def _index(folder: Path, weight_map: object) -> Path:
    write_safetensors(folder / "model-00001-of-00001.safetensors", {"w": torch.ones(1)})
    path = folder / INDEX_NAME
    path.write_text(json.dumps({"metadata": {"total_size": 4}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("file", ["sub/w.safetensors", "../w.safetensors", ".hidden.safetensors", "model.bin",
                                  "model.safetensors.json", 3, None])
def test_reader_refuses_an_index_entry_outside_the_folder_or_not_safetensors(tmp_path, file):
    path = _index(tmp_path, {"w": "model-00001-of-00001.safetensors", "v": file})
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(path)
    assert str(info.value) == f"'{path}' maps tensor 'v' to {file!r}, not a .safetensors file name in the same folder"


@pytest.mark.parametrize("raw", [b"[1, 2]", b'{"metadata": {}}', b'{"weight_map": ["a"]}', b'"weight_map"'])
def test_reader_refuses_an_index_without_a_weight_map(tmp_path, raw):
    path = _index(tmp_path, {})
    path.write_bytes(raw)
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(path)
    assert str(info.value) == (f"'{path}' is not a safetensors index: expected an object with a 'weight_map' "
                               "object of tensor name -> file name")


@pytest.mark.parametrize("raw", [b'{"weight_map": {"w": "model-0000', b"\xff\xfe{}"])
def test_reader_refuses_an_index_that_is_not_json(tmp_path, raw):
    path = _index(tmp_path, {})
    path.write_bytes(raw)
    with pytest.raises(CheckpointFormatError) as info:
        SafetensorsReader(tmp_path)
    assert info.value.path == str(path)
    assert re.fullmatch(re.escape(f"'{path}' is not valid JSON (") + r".+\)", str(info.value)), str(info.value)


# --- the sharded writer ----------------------------------------------------------------------------------
def test_writer_shard_boundaries_file_names_and_index_text(tmp_path):
    # 8 + 8 bytes fill the first shard exactly; 20 > 16 goes alone; 4 + 12 fill the third exactly
    tensors = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0]), "c": torch.arange(5.0, 10.0),
               "d": torch.tensor([10.0]), "e": torch.tensor([11, 12, 13], dtype=torch.int32)}
    out = tmp_path / "deep" / "er" / "out"  # created with its parents
    w = ShardedSafetensorsWriter(out, max_shard_bytes=16)
    for k, v in tensors.items():
        w.add(k, v)
    assert w.total_bytes == 52
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert w.close() == names
    assert _listing(out) == sorted(names + [INDEX_NAME])
    assert (out / INDEX_NAME).read_text() == (
        '{\n  "metadata": {\n    "total_size": 52\n  },\n  "weight_map": {\n'
        f'    "a": "{names[0]}",\n    "b": "{names[0]}",\n    "c": "{names[1]}",\n'
        f'    "d": "{names[2]}",\n    "e": "{names[2]}"\n  }}\n}}\n')
    for name, keys in zip(names, (["a", "b"], ["c"], ["d", "e"]), strict=True):
        metadata, got = _shard_contents(out / name)
        assert metadata == {"format": "pt"}, name  # transformers refuses shards without it
        assert list(got) == keys, name
        assert all(torch.equal(got[k], tensors[k]) and got[k].dtype == tensors[k].dtype for k in keys), name


def test_writer_keys_in_the_index_are_sorted(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=4)
    for k in ("z", "m", "a"):
        w.add(k, torch.ones(1))
    w.close()
    text = (tmp_path / INDEX_NAME).read_text()
    assert text.index('"a"') < text.index('"m"') < text.index('"z"')
    assert json.loads(text)["weight_map"] == {"z": "model-00001-of-00003.safetensors",
                                              "m": "model-00002-of-00003.safetensors",
                                              "a": "model-00003-of-00003.safetensors"}


def test_writer_one_byte_shards_and_oversized_tensors(tmp_path):
    """Every tensor is larger than the limit: each gets a shard of its own, and no shard is empty."""
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1)
    w.add("a", torch.arange(2.0))
    w.add("b", torch.tensor([5], dtype=torch.int16))
    assert w.close() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [list(_shard_contents(tmp_path / f)[1]) for f in sorted(_listing(tmp_path)) if f != INDEX_NAME] == [["a"], ["b"]]
    assert json.loads((tmp_path / INDEX_NAME).read_text())["metadata"] == {"total_size": 10}


def test_writer_one_shard_is_model_safetensors_without_an_index(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3).t(), "b": torch.tensor([1, 2], dtype=torch.int64),
               "c": torch.tensor([1.5]).to(torch.bfloat16)}
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=10**6)
    for k, v in tensors.items():
        w.add(k, v)
    assert w.close() == [SINGLE_NAME]
    assert _listing(tmp_path) == [SINGLE_NAME]
    metadata, got = _shard_contents(tmp_path / SINGLE_NAME)
    assert metadata == {"format": "pt"} and list(got) == ["a", "b", "c"]
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


@pytest.mark.parametrize("limit", [0, -1])
def test_writer_refuses_a_non_positive_shard_size(tmp_path, limit):
    with pytest.raises(ValueError) as info:
        ShardedSafetensorsWriter(tmp_path / "out", max_shard_bytes=limit)
    assert str(info.value) == f"max_shard_bytes must be positive, got {limit}"


def test_writer_refuses_a_name_twice_also_across_shards(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=4)
    w.add("a", torch.ones(1))
    w.add("b", torch.ones(1))  # "a" is in a flushed shard now
    for name in ("a", "b"):
        with pytest.raises(ValueError, match=f"^tensor '{name}' written twice$"):
            w.add(name, torch.ones(1))
    w.abort()


USER_FILES = ("model_ema.safetensors", "model-finetuned-v2.safetensors", "model-00009-of-00009.safetensors",
              "config.json", "README.md")


def _user_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in USER_FILES:
        (folder / name).write_text(f"the user's {name}")


def _check_user_files(folder: Path) -> None:
    for name in USER_FILES:
        assert (folder / name).read_text() == f"the user's {name}", name


@pytest.mark.parametrize("earlier_shards,now_shards", [(3, 1), (1, 2), (3, 2), (2, 2)])
def test_writer_removes_an_earlier_exports_weight_files_only(tmp_path, earlier_shards, now_shards):
    _user_files(tmp_path)
    _write_sharded(tmp_path, {f"old{i}": torch.full((2,), float(i)) for i in range(earlier_shards)},
                   max_shard_bytes=8)
    assert len([f for f in _listing(tmp_path) if f not in USER_FILES]) == earlier_shards + (earlier_shards > 1)
    files = _write_sharded(tmp_path, {f"new{i}": torch.full((2,), -float(i)) for i in range(now_shards)},
                           max_shard_bytes=8)
    assert _listing(tmp_path) == sorted(list(USER_FILES) + files + ([INDEX_NAME] if now_shards > 1 else []))
    _check_user_files(tmp_path)
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.keys()) == [f"new{i}" for i in range(now_shards)]
    assert all(torch.equal(reader.get(f"new{i}"), torch.full((2,), -float(i))) for i in range(now_shards))


def test_writer_replaces_an_unreadable_earlier_index(tmp_path):
    _user_files(tmp_path)
    (tmp_path / INDEX_NAME).write_text("{not json")
    assert _write_sharded(tmp_path, {"w": torch.ones(2)}, max_shard_bytes=8) == [SINGLE_NAME]
    assert _listing(tmp_path) == sorted(list(USER_FILES) + [SINGLE_NAME])
    _check_user_files(tmp_path)


def test_writer_abort_leaves_the_folder_as_it_was(tmp_path):
    _user_files(tmp_path)
    write_safetensors(tmp_path / SINGLE_NAME, {"old": torch.ones(3)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    for k in "abc":
        w.add(k, torch.ones(2))  # "a" and "b" are flushed to hidden temporary shards
    temporary = sorted(set(_listing(tmp_path)) - set(before))
    assert len(temporary) == 2 and all(re.fullmatch(r"\.tmp-shard-\d+-0000[01]\.safetensors", f) for f in temporary)
    w.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    w.abort()  # a caller's cleanup after close() aborted by itself: a second abort is harmless
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_writer_after_abort_writes_only_the_new_tensors(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=16)
    for k in "abc":
        w.add(k, torch.ones(2))
    w.abort()
    w.add("x", torch.full((2,), 1.0))
    w.add("y", torch.full((2,), 2.0))  # 8 + 8 fill the first shard exactly, as in a fresh writer
    w.add("z", torch.full((1,), 3.0))
    assert w.close() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"] == {"x": "model-00001-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
                                   "z": "model-00002-of-00002.safetensors"}
    assert _listing(tmp_path) == sorted([INDEX_NAME, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])


def test_writer_failing_shard_is_cleaned_up_and_the_error_kept(tmp_path, monkeypatch):
    """A shard whose write fails (a full disk, after part of the file was written; in ``add`` when it
    triggers the flush, in ``close`` otherwise): the original error reaches the caller, no temporary
    file is left, and the earlier export is untouched."""
    real_write = hf_io.write_safetensors

    def disk_full_on_bad(path, tensors, **kw):
        if "bad" in tensors:
            Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        if "unopened" in tensors:  # fails before the file exists (abort must not trip over it)
            raise OSError(13, "Permission denied")
        return real_write(path, tensors, **kw)

    _user_files(tmp_path)
    write_safetensors(tmp_path / SINGLE_NAME, {"old": torch.ones(3)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(hf_io, "write_safetensors", disk_full_on_bad)
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    w.add("a", torch.ones(2))
    w.add("bad", torch.ones(1))  # flushes "a"
    with pytest.raises(OSError, match="No space left on device"):
        w.close()  # aborts by itself
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    w.add("bad", torch.ones(2))
    with pytest.raises(OSError, match="No space left on device"):
        w.add("b", torch.ones(2))  # the flush of "bad" fails
    w.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    w.add("a", torch.ones(2))
    w.add("unopened", torch.ones(2))  # flushes "a"
    with pytest.raises(OSError, match="Permission denied"):
        w.close()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_writer_refuses_a_dtype_safetensors_cannot_store_when_it_is_added(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    with pytest.raises(ValueError, match=r"^tensor 'z' is torch\.complex64, which safetensors cannot store "
                                         r"\(one of \['torch\.bfloat16', .*'torch\.uint8'\]\)$"):
        w.add("z", torch.ones(1, dtype=torch.complex64))
    assert w.total_bytes == 0 and _listing(tmp_path) == []


def test_writer_with_nothing_added_refuses_to_close_and_keeps_the_earlier_export(tmp_path):
    # e.g. close() after abort(): removing the earlier export's weights for an empty one would lose it.
    _user_files(tmp_path)
    write_safetensors(tmp_path / SINGLE_NAME, {"old": torch.ones(3)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=8)
    w.add("a", torch.ones(4))
    w.add("b", torch.ones(4))  # "a" flushed to a temporary shard
    w.abort()
    with pytest.raises(ValueError, match=rf"^no tensor was added: nothing to write to {re.escape(repr(str(tmp_path)))}$"):
        w.close()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# --- atomic writes and copies -------------------------------------------------------------------------
def test_write_text_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "meta.json"
    write_text_atomic(path, "first\n")
    assert path.read_text() == "first\n" and _listing(tmp_path) == ["meta.json"]
    write_text_atomic(str(path), "second, longer\n")
    assert path.read_text() == "second, longer\n" and _listing(tmp_path) == ["meta.json"]
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")
    assert path.read_text() == "second, longer\n" and _listing(tmp_path) == ["meta.json"]


def test_copy_file_atomic_copies_exactly_and_leaves_no_temporary(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 3)
    (tmp_path / "out").mkdir()
    dst = tmp_path / "out" / "dst.bin"
    dst.write_bytes(b"an older, longer copy" * 100)
    copy_file_atomic(src, dst)
    assert dst.read_bytes() == bytes(range(256)) * 3 and _listing(tmp_path / "out") == ["dst.bin"]
    copy_file_atomic(str(src), str(tmp_path / "out" / "new.bin"))
    assert (tmp_path / "out" / "new.bin").read_bytes() == src.read_bytes()
    with pytest.raises(FileNotFoundError):
        copy_file_atomic(tmp_path / "missing.bin", dst)
    assert dst.read_bytes() == bytes(range(256)) * 3 and _listing(tmp_path / "out") == ["dst.bin", "new.bin"]


def test_copy_tokenizer_files_copies_the_tokenizer_and_generation_config_only(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    present = ["merges.txt", "generation_config.json", "tokenizer.json", "vocab.json", "chat_template.jinja"]
    for name in present + ["config.json", "model.safetensors", "tokenizer_extra.json", "README.md"]:
        (src / name).write_text(f"contents of {name}")
    (src / "tokenizer.model").mkdir()  # a folder of that name is not a tokenizer file
    dst = tmp_path / "a" / "b" / "dst"  # created with its parents
    want = ["tokenizer.json", "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json"]
    assert copy_tokenizer_files(src, dst) == want  # in TOKENIZER_FILES order
    assert _listing(dst) == sorted(want)
    assert all((dst / name).read_text() == f"contents of {name}" for name in want)
    (src / "tokenizer.json").write_text("a newer tokenizer")
    assert copy_tokenizer_files(str(src), str(dst)) == want  # into an existing folder: overwritten
    assert (dst / "tokenizer.json").read_text() == "a newer tokenizer" and _listing(dst) == sorted(want)
    for name in TOKENIZER_FILES:
        (src / name).unlink() if (src / name).is_file() else None
    assert copy_tokenizer_files(src, tmp_path / "empty") == [] and _listing(tmp_path / "empty") == []


def test_copy_tokenizer_files_knows_every_tokenizer_file_name(tmp_path):
    for name in TOKENIZER_FILES:
        (tmp_path / "src" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "src" / name).write_text(name)
    assert copy_tokenizer_files(tmp_path / "src", tmp_path / "dst") == [
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
        "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json"]


# --- dtype resolution ------------------------------------------------------------------------------------
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.mark.parametrize("source,requested,want", [
    ({BF16}, None, BF16), ({FP16}, None, FP16), ({FP32}, None, FP32),
    ({BF16}, "bf16", BF16), ({FP16}, "fp16", FP16), ({FP32}, "fp32", FP32),
    ({BF16}, "fp32", FP32), ({FP16}, "fp32", FP32), ({BF16, FP16, FP32}, "fp32", FP32),
])
def test_resolve_dtype_keeps_or_widens_without_asking(source, requested, want):
    assert resolve_dtype(source, requested, allow_lossy=False) == want


@pytest.mark.parametrize("source,requested,lost", [
    ({BF16}, "fp16", BF16), ({FP16}, "bf16", FP16), ({FP32}, "bf16", FP32), ({FP32}, "fp16", FP32),
    ({FP64}, "fp32", FP64), ({FP64}, "bf16", FP64),
])
def test_resolve_dtype_lossy_cast_needs_allow_lossy(source, requested, lost):
    target = hf_io.DTYPES[requested]
    with pytest.raises(ValueError) as info:
        resolve_dtype(source, requested, allow_lossy=False)
    assert str(info.value) == (f"converting {lost} weights to {target} loses precision; "
                               "pass --allow-lossy-dtype to do it anyway")
    assert resolve_dtype(source, requested, allow_lossy=True) == target


def test_resolve_dtype_refusals_name_the_choices():
    with pytest.raises(ValueError) as info:
        resolve_dtype({BF16, FP16}, None, allow_lossy=True)
    assert str(info.value) == "the checkpoint mixes dtypes ['torch.bfloat16', 'torch.float16']; pass --dtype"
    with pytest.raises(ValueError) as info:
        resolve_dtype({FP64}, None, allow_lossy=True)
    assert str(info.value) == "the checkpoint is torch.float64, not one of the supported ['bf16', 'fp16', 'fp32']; pass --dtype"
    with pytest.raises(ValueError) as info:
        resolve_dtype({BF16}, "int8", allow_lossy=True)
    assert str(info.value) == "unknown dtype 'int8'; valid: ['bf16', 'fp16', 'fp32']"
