"""The exporters never replace or delete a file they did not write, unless the user passes ``--overwrite``.

An HF folder written by ``convert_megatron_to_hf`` / ``export_run_to_hf`` gets a manifest,
:data:`MANIFEST_NAME`, listing the files the export wrote. Before the next export into the same folder
writes anything, :func:`check_export_target` refuses when the folder holds a file the export would
replace or remove (``model.safetensors``, the index, a ``model-0000i-of-0000n.safetensors`` shard,
``config.json``, a tokenizer file) that no earlier export listed: a user's own checkpoint, whose index
the writer would otherwise take for an earlier export's and delete with its shards.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_credit.conversion.hf_io import INDEX_NAME, SHARD_NAME, SINGLE_NAME, TOKENIZER_FILES, write_text_atomic

MANIFEST_NAME = ".megatron_credit_export.json"
CONFIG_NAME = "config.json"


def _written_before(out: Path) -> set[str]:
    try:
        files = json.loads((out / MANIFEST_NAME).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str)}


def replaced_names(out: Path) -> list[str]:
    """Files of ``out`` an export may replace or remove (see the module docstring)."""
    if not out.is_dir():
        return []
    names = []
    for p in out.iterdir():
        n = p.name
        ours = n in (SINGLE_NAME, INDEX_NAME, CONFIG_NAME) or n in TOKENIZER_FILES or SHARD_NAME.fullmatch(n)
        if p.is_file() and ours:
            names.append(n)
    return sorted(names)


def check_export_target(out: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> None:
    """Refuse (FileExistsError, before anything is written) an output folder holding files of an HF
    checkpoint that no earlier export wrote, unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{flag} {str(out)!r} exists and is not a folder")
    if overwrite:
        return
    foreign = [n for n in replaced_names(out) if n not in _written_before(out)]
    if foreign:
        more = " ..." if len(foreign) > 6 else ""
        raise FileExistsError(f"{flag} {str(out)!r} holds {', '.join(foreign[:6])}{more}, "
                              "which this export did not write and would replace or delete; choose an empty "
                              "folder, or pass --overwrite")


def write_export_manifest(out: str | os.PathLike, shards: list[str], others: list[str]) -> None:
    """Record the files this export wrote (its ``shards``, their index when there are several, and
    ``others``), after it wrote them, for the next export's check."""
    written = [*shards, *([INDEX_NAME] if len(shards) > 1 else []), *others]
    write_text_atomic(Path(out) / MANIFEST_NAME, json.dumps({"files": sorted(set(written))}, indent=1) + "\n")
