"""The checks before any GPU hour: the model, the data and the output folder a recipe names are there.

``pretrain_rl.py --dry-run`` and ``tools/plan.py`` print :func:`preflight`'s lines after the plan, and each
failure as one ``error: ...`` line (exit 2); the trainer runs the same checks before it builds anything, so
a missing model at training time is the same line, not a traceback from deep inside ``transformers``.

* **model** (``model.name_or_path``): a folder holding a ``config.json`` that ``transformers`` reads and a
  model family accepts (``families.family_for_config``), its safetensors weights (one file or every shard
  of the index), and, when prompts come from a dataset and ``data.tokenizer_path`` is unset, its tokenizer.
  A recipe with an inline ``model.architecture`` has nothing to check. A hub id is not a folder: the error
  says how to download it.
* **data** (``data.source: dataset``): ``data.train_path`` and ``data.val_path`` exist, open as parquet (from
  the footer alone) or jsonl, carry the schema's columns (``data.dataset.REQUIRED_COLUMNS``) and rows; the
  training file at least one iteration's ``rollout.prompts_per_step``. ``mc-prepare-data`` makes them.
* **output**: the run folder (or the nearest folder above it that exists) is writable, and its file system
  has room for the checkpoints the run keeps at its fullest (``checkpoint.keep`` and the one being written).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Optional

from megatron_credit.gpu_kinds import GIB
from megatron_credit.recipe.sections import SYNTHETIC_SOURCES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Check:
    """One preflight check: what was checked, and its problem (None: passed) or what was found."""

    name: str
    """``model``, ``data`` or ``output``."""
    found: str
    """What was found, for the line of a check that passed."""
    problem: Optional[str] = None
    """One line naming the field and what to do, for a check that failed."""

    def line(self) -> str:
        return f"  {self.name:<8}{self.found}" if self.problem is None else f"error: {self.problem}"


def _hub_hint(path: str) -> str:
    """How to get the checkpoint a folder path names: its hub id when the planner knows the name."""
    from megatron_credit.planning.plan import KNOWN_ARCHITECTURES, known_architecture

    row = known_architecture(path)
    hub = next((k for k, v in KNOWN_ARCHITECTURES.items() if v is row), None) if row is not None else None
    if hub is None:
        return "put a Hugging Face checkpoint folder there (config.json, *.safetensors, the tokenizer)"
    return f"download it: hf download {hub} --local-dir {path} (the recipe's examples/<recipe>.sh does)"


def check_model(recipe) -> Check:
    """The model folder: config read and accepted by a family, weights, and the tokenizer when needed."""
    from megatron_credit.conversion.hf_io import TOKENIZER_FILES, SafetensorsReader

    path = recipe.model.name_or_path
    if path is None:
        return Check(name="model", found="inline model.architecture (no checkpoint to check)")
    field = f"model.name_or_path={path}"
    if not os.path.isdir(path):
        looks_hub = not os.path.isabs(path) and path.count("/") == 1 and not path.startswith((".", "~"))
        if looks_hub:
            return Check(name="model", found="", problem=f"{field} is not a folder: the trainer reads a local "
                         f"checkpoint; download it: hf download {path} --local-dir /models/{path.split('/')[-1]} "
                         f"and pass model.name_or_path=/models/{path.split('/')[-1]}")
        return Check(name="model", found="", problem=f"{field}: no such folder; {_hub_hint(path)}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return Check(name="model", found="", problem=f"{field}: the folder has no config.json; {_hub_hint(path)}")
    try:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        return Check(name="model", found="", problem=f"{field}: config.json cannot be read ({' '.join(str(exc).split())})")
    from megatron_credit.families import family_for_config

    try:
        family = family_for_config(cfg)
        weights = SafetensorsReader(path)
    except (OSError, ValueError) as exc:
        return Check(name="model", found="", problem=f"{field}: {' '.join(str(exc).split())}")
    if recipe.data.source not in SYNTHETIC_SOURCES and recipe.data.tokenizer_path is None:  # the model's tokenizer
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES[:3]):
            return Check(name="model", found="", problem=f"{field}: no tokenizer (tokenizer.json, tokenizer_config.json "
                         "or tokenizer.model) in the folder; copy the checkpoint's or set data.tokenizer_path")
    files = len(set(weights.weight_map.values()))
    archs = ",".join(getattr(cfg, "architectures", None) or [cfg.model_type])
    return Check(name="model", found=f"{path}: ok ({archs}, family {family.name}, {len(weights.weight_map):,} "
                                     f"tensors in {files} safetensors file(s))")


def data_file_rows(path: str) -> tuple[int, tuple[str, ...]]:
    """(rows, columns) of a parquet file (from its footer) or a jsonl file (lines; columns of the first row)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as exc:  # pyarrow raises its own ArrowInvalid for a file that is not parquet
            raise ValueError(f"not a readable parquet file ({' '.join(str(exc).split())})") from None
        return meta.num_rows, tuple(meta.schema.to_arrow_schema().names)
    if path.endswith((".jsonl", ".json")):
        rows, columns = 0, ()
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                if rows == 0:
                    try:
                        first = json.loads(line)
                    except ValueError:
                        raise ValueError("the first line is not JSON") from None
                    columns = tuple(first) if isinstance(first, dict) else ()
                rows += 1
        return rows, columns
    raise ValueError("unsupported format; use .parquet or .jsonl")


def check_data(recipe) -> Check:
    """The dataset files of ``data.source: dataset``: there, readable, the schema's columns, enough rows."""
    from megatron_credit.data.dataset import REQUIRED_COLUMNS

    d = recipe.data
    if d.source != "dataset":
        return Check(name="data", found=f"data.source={d.source} (generated, no files)")
    found = []
    for field, path, least in (("data.train_path", d.train_path, recipe.rollout.prompts_per_step),
                               ("data.val_path", d.val_path, 1)):
        if path is None:
            continue
        where = f"{field}={path}"
        if not os.path.isfile(path):
            folder = os.path.dirname(path) or "."
            return Check(name="data", found="", problem=f"{where}: no such file; make it with mc-prepare-data --out "
                         f"{folder} (docs/data.md), or pass {field}=<your DAPO-schema .parquet or .jsonl>")
        try:
            rows, columns = data_file_rows(path)
        except (OSError, ValueError) as exc:
            return Check(name="data", found="", problem=f"{where}: {exc}")
        if rows < least:
            return Check(name="data", found="", problem=f"{where}: {rows} row(s), fewer than " + (
                f"rollout.prompts_per_step={least}" if least > 1 else "one"))
        missing = [c for c in REQUIRED_COLUMNS if c not in columns]
        if missing:
            return Check(name="data", found="", problem=f"{where}: no column(s) {missing} (found {list(columns)}); "
                         "the recipes read the DAPO-Math-17K schema (docs/data.md; mc-prepare-data converts)")
        found.append(f"{path} ({rows:,} rows)")
    return Check(name="data", found="ok: " + ", ".join(found))


def _nearest_existing(path: str) -> str:
    """``path`` or the nearest path above it that exists (a folder, or a file in the way)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_output(run_dir: str, *, checkpoint_bytes: int, keep: int) -> Check:
    """The run folder: writable (a file is created and removed in it, or in the nearest folder above it
    that exists), with room on its file system for the checkpoints the run keeps at its fullest: ``keep``
    of ``checkpoint_bytes`` each and the one being written, less those a resumed run already holds."""
    from megatron_credit.run_dir import complete_checkpoints

    held = min(len(complete_checkpoints(run_dir)), keep)
    need_bytes = (keep + 1 - held) * checkpoint_bytes
    where = _nearest_existing(run_dir)
    if not os.path.isdir(where):
        return Check(name="output", found="", problem=f"--output-dir {run_dir}: {where} is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".mc-preflight-"):
            pass
    except OSError as exc:
        return Check(name="output", found="", problem=f"--output-dir {run_dir}: cannot write in {where} "
                     f"({exc.strerror or exc}); pass a writable --output-dir")
    free = shutil.disk_usage(where).free
    if free < need_bytes:
        return Check(name="output", found="", problem=f"--output-dir {run_dir}: {need_bytes / GIB:,.1f} GiB needed for "
                     f"the checkpoints kept at the fullest (checkpoint.keep={keep} + the one being written, "
                     f"{checkpoint_bytes / GIB:,.1f} GiB each, less {held} already there), "
                     f"{free / GIB:,.1f} GiB free in {where}; lower checkpoint.keep or use a larger file system")
    return Check(name="output", found=f"{run_dir}: ok (writable; {free / GIB:,.0f} GiB free for up to "
                                      f"{need_bytes / GIB:,.1f} GiB of checkpoints)")


def preflight(recipe, *, run_dir: str, checkpoint_bytes: int) -> list[Check]:
    """Every check of the module docstring, in order: model, data, output (``checkpoint_bytes``: one save)."""
    return [check_model(recipe), check_data(recipe),
            check_output(run_dir, checkpoint_bytes=checkpoint_bytes, keep=recipe.checkpoint.keep)]


def refuse(checks: list[Check]) -> None:
    """Raise one ``ValueError`` naming every failed check (for the trainer: one ``error:`` line)."""
    problems = [c.problem for c in checks if c.problem is not None]
    if problems:
        raise ValueError("; ".join(problems))
