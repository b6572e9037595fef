"""Checks a megatron ``torch_dist`` checkpoint folder before torch reads it: no code runs from it.

torch's distributed-checkpoint reader unpickles ``<dir>/.metadata`` with plain ``pickle.load``, and
loads every byte item it is asked for (megatron's ``ShardedObject`` entries, e.g. each linear layer's
``_extra_state``) with ``torch.load(..., weights_only=False)``. A crafted checkpoint therefore runs
arbitrary code during a load. So, before megatron and torch see a folder:

* ``.metadata`` is read by :class:`_MetadataUnpickler`, which resolves only the classes torch writes
  there (the dataclasses and enums of ``torch.distributed.checkpoint.metadata`` / ``.planner``, the
  storage record of ``.filesystem``, torch dtypes, ``torch.Size``, ``torch.serialization._get_layout``)
  and builtin containers; any other global (``os.system``, ``builtins.eval``, ...) raises
  :class:`UnsafeCheckpointError` naming it, before anything is called;
* every data file the metadata names must exist and hold the bytes it promises (a deleted or
  truncated ``__0_0.distcp`` is one clear error, not a failure deep in a reader thread),
  ``metadata.json`` must be present and well-formed, and the checkpoint's common (non-tensor) state
  must be there in one of megatron's two formats: ``common.pt`` (megatron-core <= 0.16 wrote it;
  0.19 still reads it), or the byte item ``common_state/shard_0_1`` inside the ``.distcp`` files
  (megatron-core 0.19 writes only that: ``dist_checkpointing/serialization.py``); that item is
  loaded here with ``weights_only=True`` at once, since torch's planner unpickles it with
  ``weights_only=False`` before megatron's own ``weights_only=True`` load sees it;
* :func:`weights_only_byte_items` makes each byte item pass ``torch.load(weights_only=True)`` before
  torch's own ``weights_only=False`` load of the same bytes runs, so only tensors, containers and
  primitive values are ever built from them.

``common.pt`` is loaded by megatron with ``torch.load``'s default, ``weights_only=True`` (torch >= 2.6).
A megatron-core that predates the ``common_state`` format cannot load such a checkpoint: that is one
clear error too (:func:`check_dist_checkpoint`), not megatron's ``Common file ... does not exist``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Collection, Iterator, Optional

import torch

from megatron_credit.conversion.hf_io import CheckpointFormatError

METADATA_NAME = ".metadata"
COMMON_NAME = "common.pt"
COMMON_STATE_KEY = "common_state/shard_0_1"
"""megatron-core 0.19's place for the common state: ``ShardedObject("common_state", ...)``'s unique key."""
MEGATRON_META_NAME = "metadata.json"

_DCP = "torch.distributed.checkpoint"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                      "TensorStorageMetadata", "BytesStorageMetadata",
                                      "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                       "BytesIOWriteData", "LoadPlan", "ReadItem", "LoadItemType")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")]
    + [("torch", str(d).removeprefix("torch.")) for d in vars(torch).values() if isinstance(d, torch.dtype)]
)
"""What torch's ``FileSystemWriter`` pickles into ``.metadata`` (checked on torch 2.13)."""


class UnsafeCheckpointError(CheckpointFormatError):
    """A checkpoint file that would run code (or build objects torch never writes) when unpickled."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_ALLOWED_GLOBALS` (and never persistent ids)."""

    def __init__(self, file, path: Path):
        super().__init__(file, fix_imports=False)  # the names checked are the names resolved
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                self.path, f"references {module}.{name}, which torch never writes into checkpoint metadata; "
                "refusing to unpickle it (a crafted file runs code this way). Only load checkpoints you trust")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self.path, "holds a persistent id, which checkpoint metadata never does")


def read_dist_metadata(model_dir: str | os.PathLike):
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of a dist checkpoint folder, unpickled
    safely; CheckpointFormatError (UnsafeCheckpointError) naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(model_dir) / METADATA_NAME
    if not path.is_file():
        raise CheckpointFormatError(path, "is missing: not a torch_dist checkpoint folder, or an incomplete one")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001  (truncated or random bytes: any unpickling failure)
        raise CheckpointFormatError(path, f"cannot be read ({type(exc).__name__}: {exc}): truncated or "
                                    "not a torch_dist checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(path, f"holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


def check_dist_checkpoint(model_dir: str | os.PathLike):
    """Check a dist checkpoint folder as described in the module docstring; returns its metadata."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"no dist checkpoint at {str(model_dir)!r}")
    metadata = read_dist_metadata(model_dir)
    if not (model_dir / MEGATRON_META_NAME).is_file():
        raise CheckpointFormatError(model_dir / MEGATRON_META_NAME, "is missing: the checkpoint is incomplete")
    in_distcp = COMMON_STATE_KEY in (metadata.state_dict_metadata or {})
    if not in_distcp and not (model_dir / COMMON_NAME).is_file():
        raise CheckpointFormatError(model_dir / COMMON_NAME, f"is missing, and {METADATA_NAME} names no "
                                    f"{COMMON_STATE_KEY!r} item (megatron-core 0.19's place for the common state): "
                                    "the checkpoint is incomplete")
    try:
        backend = json.loads((model_dir / MEGATRON_META_NAME).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(model_dir / MEGATRON_META_NAME, f"is not valid JSON ({exc})") from None
    if not isinstance(backend, dict) or backend.get("sharded_backend") != "torch_dist":
        raise CheckpointFormatError(model_dir / MEGATRON_META_NAME,
                                    f"does not name the torch_dist backend: {backend!r:.100}")
    needed: dict[str, int] = {}  # file -> bytes it must hold
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or Path(rel).name != rel:
            raise CheckpointFormatError(model_dir / METADATA_NAME, f"storage entry of {index} is {info!r:.100}, "
                                        "not a file in the checkpoint folder")
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, nbytes in sorted(needed.items()):
        path = model_dir / rel
        if not path.is_file():
            raise CheckpointFormatError(path, f"is missing (named by {METADATA_NAME}): the checkpoint is incomplete")
        size = path.stat().st_size
        if size < nbytes:
            raise CheckpointFormatError(path, f"is {size} bytes, but {METADATA_NAME} places data up to byte "
                                        f"{nbytes}: truncated")
    if in_distcp and not (model_dir / COMMON_NAME).is_file():  # megatron reads common.pt first when present
        _check_common_state(model_dir, metadata)
    return metadata


def _check_common_state(model_dir: Path, metadata) -> None:
    """The 0.19 format's ``common_state/shard_0_1``: a plain byte item (weights_only=True), and a
    megatron-core that reads it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if not isinstance(metadata.state_dict_metadata[COMMON_STATE_KEY], BytesStorageMetadata):
        raise CheckpointFormatError(model_dir / METADATA_NAME, f"names {COMMON_STATE_KEY!r} as a tensor, not the "
                                    "byte item megatron writes there")
    found = [(i, info) for i, info in (metadata.storage_data or {}).items() if i.fqn == COMMON_STATE_KEY]
    if len(found) != 1:
        raise CheckpointFormatError(model_dir / METADATA_NAME, f"has {len(found)} storage entries for "
                                    f"{COMMON_STATE_KEY!r}, not the one megatron writes")
    _check_stored_byte_item(model_dir, *found[0])
    if not megatron_reads_common_state():
        from megatron.core import package_info

        raise CheckpointFormatError(model_dir, f"keeps its common state in the .distcp files ({COMMON_STATE_KEY!r}, "
                                    f"written by megatron-core >= 0.19), which the installed megatron-core "
                                    f"{package_info.__version__} cannot read: load it with megatron-core>=0.19")


def megatron_reads_common_state() -> bool:
    """Whether the installed megatron-core loads the 0.19 format (``common_state`` in the ``.distcp``
    files); 0.16.1's ``load`` knows only ``common.pt``."""
    from megatron.core.dist_checkpointing import serialization

    return hasattr(serialization, "_legacy_common_state_exists")  # 0.19.2's split of the two formats


def stored_weight_dtypes(metadata, *, keys: Optional[Collection[str]] = None) -> set[torch.dtype]:
    """The dtypes of the weight tensors a dist checkpoint stores (from its metadata), norms excepted:
    megatron keeps layer-norm weights in fp32 in a bf16 model. ``keys``: only those checkpoint keys."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {m.properties.dtype for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and "norm" not in key and (keys is None or key in keys)}


def _check_byte_item(value: io.BytesIO, *, where: str, item: str) -> None:
    """Load one byte item with ``weights_only=True``: a pickle that needs more is refused
    (:class:`UnsafeCheckpointError`), bytes torch cannot read are :class:`CheckpointFormatError`."""
    try:
        torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(where, f"byte item {item!r} does not load with weights_only=True "
                                    f"({str(exc).strip().splitlines()[0]}); refusing it") from None
    except Exception as exc:  # noqa: BLE001  (corrupt bytes: torch's zip reader fails in many ways)
        raise CheckpointFormatError(where, f"byte item {item!r} is corrupt ({type(exc).__name__}: "
                                    f"{str(exc).strip()[:200]})") from None


@contextlib.contextmanager
def weights_only_byte_items(where: str) -> Iterator[None]:
    """While active, every byte item torch's load planner reads must load with ``weights_only=True``.

    torch's ``DefaultLoadPlanner.load_bytes`` (megatron's planner inherits it) calls
    ``torch.load(value, weights_only=False)``. The wrapper loads the same bytes with
    ``weights_only=True`` first and raises :class:`UnsafeCheckpointError` (naming ``where`` and the
    item) if that refuses them; then the original runs on bytes known to build nothing unsafe.
    Not thread-safe (it patches a class attribute); the converters and a resume load run it alone.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _check_byte_item(value, where=where, item=read_item.dest_index.fqn)
        value.seek(0)
        original(self, read_item, value)

    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        DefaultLoadPlanner.load_bytes = original


@contextlib.contextmanager
def checkpoint_errors_unwrapped() -> Iterator[None]:
    """Re-raise a :class:`CheckpointFormatError` that torch's checkpoint reader wrapped.

    torch collects each rank's exception into a ``CheckpointException``, a ``BaseException`` whose
    message is a multi-line traceback dump; the first ``CheckpointFormatError`` among its failures is
    raised instead (chained to it), so that a refused checkpoint reads as one line.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointFormatError):
                raise inner from exc
        raise


def check_byte_items(model_dir: str | os.PathLike, metadata) -> int:
    """Load every byte item of a dist checkpoint (megatron's ``ShardedObject`` entries, e.g. each layer's
    ``_extra_state``) with ``torch.load(weights_only=True)`` from the file and offset ``metadata``
    places it at, before any load runs: a crafted item is refused up front (``UnsafeCheckpointError``
    naming the file and the item), not half-way through filling a model. Items stored through a
    transform (compression, never written by megatron) are left to :func:`weights_only_byte_items`,
    which guards the load itself. Returns the number of items checked."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model_dir = Path(model_dir)
    byte_keys = {k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    checked = 0
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: str(kv[0].fqn)):
        if index.fqn not in byte_keys or getattr(info, "transform_descriptors", None):
            continue
        _check_stored_byte_item(model_dir, index, info)
        checked += 1
    return checked


def _check_stored_byte_item(model_dir: Path, index, info) -> None:
    """:func:`_check_byte_item` on the bytes ``info`` places in a file of ``model_dir``."""
    path = model_dir / info.relative_path  # a plain name inside the folder: check_dist_checkpoint
    with open(path, "rb") as f:
        f.seek(int(info.offset))
        blob = f.read(int(info.length))
    _check_byte_item(io.BytesIO(blob), where=path, item=index.fqn)


def check_weights_only_file(path: str | os.PathLike) -> None:
    """A ``torch.save`` file (a trainer's per-rank RNG / data-cursor file) must load with
    ``weights_only=True``; memory-mapped, so its tensors are not read. CheckpointFormatError
    (UnsafeCheckpointError for a pickle that builds anything else) naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointFormatError(path, "is missing: the checkpoint is incomplete")
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(path, f"does not load with weights_only=True "
                                    f"({str(exc).strip().splitlines()[0]}); refusing it") from None
    except Exception as exc:  # noqa: BLE001  (truncated or random bytes)
        raise CheckpointFormatError(path, f"cannot be read ({type(exc).__name__}: {str(exc).strip()[:200]}): "
                                    "truncated or not a torch.save file") from None
