"""Streaming safetensors I/O for HF checkpoint folders, tokenizer files and dtype checks.

:class:`SafetensorsReader` opens a folder (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) and reads one tensor at a time. :class:`ShardedSafetensorsWriter`
buffers tensors up to ``max_shard_bytes``, writes a shard, and at ``close`` names the shards
``model-0000i-of-0000n.safetensors`` and writes the index, as ``save_pretrained`` does: peak memory is
one shard's tensors (references to the source where no transform copied them), never the model. Like
``save_pretrained`` it removes the weight files of an earlier save into the same folder that this one
does not overwrite, so that a reader never mixes two saves.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
            weight_map = json.loads(index.read_text())["weight_map"]
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

    def _header(self, file: str) -> tuple[dict, int]:
        """(name -> {dtype, shape, data_offsets}, byte offset of the data) of one safetensors file."""
        if file not in self._headers:
            with open(self.dir / file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self._headers[file] = (header, 8 + n)
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
                raise ValueError(f"{file!r} is truncated (tensor {name!r})")
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
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if name in self._buffer or any(name in names for _, names in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = f"tmp-shard-{len(self._files):05d}.safetensors"
        write_safetensors(self.dir / tmp, self._buffer, metadata={"format": "pt"})
        self._files.append((tmp, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, name the shards, write the index (one file: no index, like ``save_pretrained``)."""
        if self._buffer:
            self._flush()
        n = len(self._files)
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
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def remove_stale_weight_files(folder: Path, *, keep: set[str]) -> list[str]:
    """Delete ``model*.safetensors`` and ``model.safetensors.index.json`` in ``folder`` not in ``keep``
    (only those patterns: other files, e.g. a README, are left alone); returns the names removed."""
    stale = [p for p in folder.glob("model*.safetensors") if p.name not in keep]
    if INDEX_NAME not in keep and (folder / INDEX_NAME).is_file():
        stale.append(folder / INDEX_NAME)
    for p in stale:
        p.unlink()
    return sorted(p.name for p in stale)


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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer (and generation config) files that exist in ``src``; returns their names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
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
