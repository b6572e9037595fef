"""Streaming safetensors I/O for HF checkpoint folders, tokenizer files and dtype checks.

:class:`SafetensorsReader` opens a folder (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) and reads one tensor at a time. :class:`ShardedSafetensorsWriter`
buffers tensors up to ``max_shard_bytes``, writes a shard, and at ``close`` names the shards
``model-0000i-of-0000n.safetensors`` and writes the index, as ``save_pretrained`` does: peak memory is
one shard's tensors (references to the source where no transform copied them), never the model. Like
``save_pretrained`` it removes the weight files of an earlier save into the same folder that this one
does not overwrite, so that a reader never mixes two saves, but only files a save writes:
``model.safetensors``, the index, and the ``model-0000i-of-0000n.safetensors`` shards that index names.
A user's ``model_ema.safetensors`` next to them is never touched. Shards are written under hidden
temporary names and renamed at ``close``; a failure (``abort``) removes them, so no half-written
shard is ever left under a final name.

The reader checks each file before trusting it: a file shorter than its 8-byte header length, a
header length past the end of the file, a header that is not a JSON object of ``{dtype, shape,
data_offsets}``, offsets outside the data or disagreeing with the shape, and an index that is not
JSON, has no ``weight_map``, or names a file outside the folder raise :class:`CheckpointFormatError`
naming the file.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The safetensors format caps the JSON header at 100 MB (safetensors' own reader refuses more).
MAX_HEADER_BYTES = 100 * 1000 * 1000
# What a save writes: the single file, the index, and shards named like ``save_pretrained``'s.
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class CheckpointFormatError(ValueError):
    """A checkpoint file that is missing a part, truncated or not what its format says; names the file."""

    def __init__(self, path: str | os.PathLike, why: str):
        super().__init__(f"{str(path)!r} {why}")
        self.path, self.why = str(path), why

    def __reduce__(self):  # torch's checkpoint reader copies exceptions across threads by pickling
        return type(self), (self.path, self.why)


class SafetensorsReader:
    """Tensor-by-tensor access to an HF checkpoint folder, with plain file reads.

    Not memory-mapped on purpose: pages of a mapped file that were read stay in the process's RSS
    until the mapping closes, so an mmap reader streaming a whole checkpoint ends up holding it
    (page cache, but counted and charged to the process). Here each ``get`` reads one tensor's bytes.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"HF checkpoint folder {str(self.dir)!r} does not exist")
        index = self.dir / INDEX_NAME
        if index.is_file() and (self.dir / SINGLE_NAME).is_file():
            # transformers prefers the single file, we would prefer the index: which is current is unknown
            raise ValueError(f"{str(self.dir)!r} holds both {SINGLE_NAME} and {INDEX_NAME} (two saves into one "
                             "folder?); remove the stale one")
        if index.is_file():
            weight_map = read_index(index)
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = None
        else:
            found = sorted(p.name for p in self.dir.iterdir())
            raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {str(self.dir)!r} (found {found}); "
                                    "only safetensors checkpoints are supported")
        self._headers: dict[str, tuple[dict, int]] = {}
        if weight_map is None:
            self.weight_map = {k: SINGLE_NAME for k in self._header(SINGLE_NAME)[0]}
        else:
            for f in sorted(set(weight_map.values())):
                if not (self.dir / f).is_file():
                    raise FileNotFoundError(f"shard {f!r} listed in {INDEX_NAME} is missing from {str(self.dir)!r}")
            self.weight_map = dict(weight_map)
            for f in sorted(set(weight_map.values())):
                stored = self._header(f)[0]
                listed = sorted(k for k, v in weight_map.items() if v == f and k not in stored)
                if listed:
                    raise CheckpointFormatError(self.dir / INDEX_NAME, f"lists {len(listed)} tensor(s) for {f!r} "
                                                f"that it does not store, e.g. {listed[:3]}")

    def _header(self, file: str) -> tuple[dict, int]:
        """(name -> {dtype, shape, data_offsets}, byte offset of the data) of one safetensors file."""
        if file not in self._headers:
            self._headers[file] = read_header(self.dir / file)
        return self._headers[file]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def _info(self, name: str) -> tuple[str, dict, int]:
        try:
            file = self.weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {str(self.dir)!r}") from None
        header, base = self._header(file)
        if name not in header:
            raise KeyError(f"tensor {name!r} is listed for {file!r} but not stored there")
        return file, header[name], base

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from disk now into its own memory."""
        file, info, base = self._info(name)
        start, end = info["data_offsets"]
        dtype = _st_dtype(info["dtype"])
        buf = bytearray(end - start)
        with open(self.dir / file, "rb") as f:
            f.seek(base + start)
            if f.readinto(buf) != len(buf):
                raise CheckpointFormatError(self.dir / file, f"is truncated (tensor {name!r})")
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def dtypes(self, names=None) -> set[torch.dtype]:
        """The dtypes stored (from the headers), of ``names`` (default: every tensor)."""
        return {_st_dtype(self._info(name)[1]["dtype"]) for name in (self.weight_map if names is None else names)}

    def total_bytes(self) -> int:
        return sum((self.dir / f).stat().st_size for f in set(self.weight_map.values()))


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _st_dtype(name: str) -> torch.dtype:
    if name not in _ST_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {name}")
    return _ST_DTYPES[name]


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value of file ``path``; CheckpointFormatError naming it when it is not valid JSON (or not
    UTF-8). The caller checks the value's shape, with its own words for what the file should be."""
    try:
        return json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(path, f"is not valid JSON ({exc})") from None


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, checked: tensor name -> file name in
    the same folder (no path separators, so a crafted index cannot point outside the folder)."""
    index = read_json(path)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointFormatError(path, "is not a safetensors index: expected an object with a "
                                    "'weight_map' object of tensor name -> file name")
    weight_map = index["weight_map"]
    for name, file in weight_map.items():
        if (not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file
                or file.startswith(".")):
            raise CheckpointFormatError(path, f"maps tensor {name!r} to {file!r}, not a .safetensors file "
                                        "name in the same folder")
    return weight_map


def read_header(path: Path) -> tuple[dict, int]:
    """(name -> {dtype, shape, data_offsets}, byte offset of the data) of one safetensors file, after
    checking that the header is well-formed and every tensor's bytes lie inside the file and match its
    shape and dtype (CheckpointFormatError naming the file otherwise)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(path, f"is {size} bytes, too short for a safetensors file "
                                        "(8-byte header length + JSON header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointFormatError(path, f"header length {n} is larger than the file ({size} bytes): "
                                        "truncated or not a safetensors file")
        if n > MAX_HEADER_BYTES:
            raise CheckpointFormatError(path, f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit of "
                                        "safetensors headers: not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(path, f"header is not valid JSON ({exc}): truncated or not a safetensors "
                                    "file") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(path, f"header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        _check_entry(path, name, info, data_bytes)
    return header, 8 + n


def _check_entry(path: Path, name: str, info: object, data_bytes: int) -> None:
    """One header entry: known dtype, a shape of non-negative ints, offsets inside the data whose
    length is exactly shape x itemsize."""
    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(path, f"tensor {name!r}: {why}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad(f"header entry {info!r:.80} is not {{dtype, shape, data_offsets}}")
    if info["dtype"] not in _ST_DTYPES:
        raise bad(f"unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise bad(f"shape {shape!r:.80} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r:.80} is not [begin, end]")
    numel = 1
    for d in shape:
        numel *= d
    want = numel * _ST_DTYPES[info["dtype"]].itemsize
    if offsets[1] - offsets[0] != want:
        raise bad(f"header shape {shape} x {info['dtype']} needs {want} bytes, data_offsets span "
                  f"{offsets[1] - offsets[0]}")
    if offsets[1] > data_bytes:
        raise bad(f"data ends at byte {offsets[1]} past the end of the data ({data_bytes} bytes): truncated")


class ShardedSafetensorsWriter:
    """Write tensors in order into size-bounded shards plus ``model.safetensors.index.json``."""

    def __init__(self, out_dir: str | os.PathLike, *, max_shard_bytes: int = 5 * 1024**3):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r} is {tensor.dtype}, which safetensors cannot store "
                             f"(one of {sorted(map(str, _ST_NAMES))})")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if name in self._buffer or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = f".tmp-shard-{os.getpid()}-{len(self._files):05d}.safetensors"
        self._files.append((tmp, list(self._buffer)))  # first: abort() removes a half-written one too
        write_safetensors(self.dir / tmp, self._buffer, metadata={"format": "pt"})
        self._buffer, self._buffer_bytes = {}, 0

    def abort(self) -> None:
        """Remove the temporary shards written so far (after a failure); final names are untouched."""
        for tmp, _ in self._files:
            (self.dir / tmp).unlink(missing_ok=True)
        self._files, self._buffer, self._buffer_bytes = [], {}, 0

    def close(self) -> list[str]:
        """Flush, name the shards, write the index (one file: no index, like ``save_pretrained``)."""
        try:
            if self._buffer:
                self._flush()
        except BaseException:
            self.abort()
            raise
        n = len(self._files)
        if n == 0:  # before anything is removed: the folder's earlier export stays whole
            raise ValueError(f"no tensor was added: nothing to write to {str(self.dir)!r}")
        finals = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        remove_stale_weight_files(self.dir, keep=set(finals) | ({INDEX_NAME} if n > 1 else set()))
        if n == 1:
            os.replace(self.dir / self._files[0][0], self.dir / SINGLE_NAME)
            return [SINGLE_NAME]
        weight_map, names = {}, []
        for (tmp, tensors), final in zip(self._files, finals, strict=True):
            os.replace(self.dir / tmp, self.dir / final)
            weight_map.update({t: final for t in tensors})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        write_text_atomic(self.dir / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def remove_stale_weight_files(folder: Path, *, keep: set[str]) -> list[str]:
    """Delete the weight files of an earlier save in ``folder`` that are not in ``keep``; returns the
    names removed.

    Only what a save writes counts as an earlier save: ``model.safetensors``, the index, and the shards
    the index names that are called ``model-0000i-of-0000n.safetensors``. Nothing else is removed: not
    a user's ``model_ema.safetensors`` or ``model-finetuned-v2.safetensors``, not a shard-named file the
    index does not list, not a README. An index that cannot be read names no shards (it is still
    replaced or removed: a stale index next to a new ``model.safetensors`` makes the folder ambiguous).
    """
    candidates = {SINGLE_NAME, INDEX_NAME}
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            candidates.update(f for f in read_index(index).values() if SHARD_NAME.fullmatch(f))
        except CheckpointFormatError:
            pass
    stale = sorted(name for name in candidates - keep if (folder / name).is_file())
    for name in stale:
        (folder / name).unlink()
    return stale


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary name next to ``path``, then rename: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def copy_file_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``shutil.copyfile`` through a temporary name next to ``dst`` (see :func:`write_text_atomic`)."""
    dst = Path(dst)
    tmp = dst.with_name(f".tmp-{os.getpid()}-{dst.name}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *,
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file tensor by tensor, without a serialised copy of the whole file.

    ``safetensors.torch.save_file`` turns every tensor into ``bytes`` first (a second copy of the
    shard in memory); this writes the same format (8-byte little-endian header length, JSON header
    padded with spaces to 8 bytes, then the raw little-endian data in header order) from the tensors'
    own memory.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # a failure never leaves a half-written file
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in tensors.values():
                if t.numel():
                    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer (and generation config) files that exist in ``src``; returns their names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            copy_file_atomic(src / name, dst / name)
            copied.append(name)
    return copied


def resolve_dtype(source: set[torch.dtype], requested: str | None, *, allow_lossy: bool) -> torch.dtype:
    """The output dtype: the source's when not requested; a lossy cast needs ``allow_lossy``.

    bf16 -> fp16 loses range, fp16 -> bf16 and fp32 -> 16-bit lose mantissa: refused by default,
    so that a conversion never changes the weights silently.

    >>> resolve_dtype({torch.bfloat16}, "fp32", allow_lossy=False)
    torch.float32
    >>> resolve_dtype({torch.float32}, "bf16", allow_lossy=False)
    Traceback (most recent call last):
    ...
    ValueError: converting torch.float32 weights to torch.bfloat16 loses precision; pass --allow-lossy-dtype to do it anyway
    """
    if requested is None:
        if len(source) != 1:
            raise ValueError(f"the checkpoint mixes dtypes {sorted(map(str, source))}; pass --dtype")
        (only,) = source
        if only not in DTYPES.values():
            raise ValueError(f"the checkpoint is {only}, not one of the supported {sorted(DTYPES)}; pass --dtype")
        return only
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; valid: {sorted(DTYPES)}")
    target = DTYPES[requested]
    lossy = [s for s in source if (s != target and target != torch.float32) or s == torch.float64]
    if lossy and not allow_lossy:
        raise ValueError(f"converting {lossy[0]} weights to {target} loses precision; "
                         "pass --allow-lossy-dtype to do it anyway")
    return target
