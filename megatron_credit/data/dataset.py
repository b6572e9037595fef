"""Prompt datasets in the DAPO-Math-17K schema, from parquet or jsonl.

Schema (one row per prompt)::

    data_source:  str                                   e.g. "math_dapo"; selects the verifier, must be
                                                        registered in ``rewards.base.VERIFIER_BY_DATA_SOURCE``
    prompt:       list[{"role": str, "content": str}]   chat messages, roles system / user / assistant
                                                        (jsonl may give a plain str)
    reward_model: {"ground_truth": str, ...}            the reference answer, not blank (int/float
                                                        accepted; an integral float 42.0 becomes "42",
                                                        because the DAPO string verifier never matches
                                                        "42.0")
    extra_info:   dict | null                           carried through untouched

Loading = read and validate rows -> drop repeated prompts (the public DAPO-Math-17K parquet holds each
of its ~17.9K prompts about 100 times; the key is data source + messages + ground truth) -> render with
the tokenizer's chat template and tokenize -> drop prompts over ``max_prompt_len`` tokens. Each step's
count is in ``DatasetStats``. A malformed row raises ``DatasetFormatError`` naming the file, the row
index (0-based, counted over the whole file) and the column; with ``skip_malformed=True`` it is skipped
and counted instead (per column in ``DatasetStats.malformed_by_column``); a jsonl line that is not
UTF-8 is a malformed row like any other. Files that yield no prompt at all (empty, or every row
skipped or filtered) raise ``EmptyDatasetError`` with the counts, never an empty dataset whose
``batches()`` yields nothing. A file the reader cannot open as parquet (zero bytes, another format)
raises ``DatasetFormatError`` naming it. A record's ``uid`` is ``"{file index}:{file name}:{row}"`` (the file's position in
``paths``), unique even for same-named files in different folders.

The tokenizer is anything with the Hugging Face methods ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)`` and ``encode(text, add_special_tokens=False)``: a ``transformers``
tokenizer or ``data.tokenizer.ArithTokenizer``. Special tokens come from the template text, not from
``encode`` (templates already write their BOS).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.rewards.base import VERIFIER_BY_DATA_SOURCE

REQUIRED_COLUMNS = ("prompt", "reward_model")
ROLES = ("system", "user", "assistant")


class DatasetFormatError(ValueError):
    """A row that does not follow the schema; the message names file, row and column."""

    def __init__(self, path: str | Path, row: int | None, column: str, why: str):
        where = f"{path}" + (f", row {row}" if row is not None else "")
        super().__init__(f"{where}, column '{column}': {why}")
        self.path, self.row, self.column, self.why = str(path), row, column, why

    def __reduce__(self):  # picklable across processes despite the custom signature
        return type(self), (self.path, self.row, self.column, self.why)


class EmptyDatasetError(ValueError):
    """The files yielded no prompt; the message gives the counts of what was read and dropped."""


@dataclasses.dataclass(kw_only=True)
class DatasetStats:
    """What loading kept and dropped (counts over all files)."""

    rows: int = 0
    """Rows read."""
    malformed: int = 0
    """Rows skipped as malformed (only with ``skip_malformed``)."""
    malformed_by_column: dict[str, int] = dataclasses.field(default_factory=dict)
    """``malformed`` split by the column that was wrong (``"<json>"``, ``"<utf-8>"`` for unreadable lines)."""
    duplicates: int = 0
    """Rows dropped as repeats of an earlier prompt."""
    too_long: int = 0
    """Prompts dropped for exceeding ``max_prompt_len`` tokens."""
    kept: int = 0
    """Prompts in the dataset."""

    def too_long_warning(self, where: str, *, fraction: float = 0.1) -> str | None:
        """A warning line when more than ``fraction`` of the valid prompts were over ``max_prompt_len``."""
        valid = self.kept + self.too_long
        if self.too_long <= fraction * valid:
            return None
        return (f"warning: {where}: {self.too_long} of {valid} prompts are over data.max_prompt_len and were "
                f"dropped ({self.summary()}); raise data.max_prompt_len to train on them")

    def summary(self) -> str:
        """One line of counts, e.g. ``read 3 rows, skipped 3 malformed (data_source: 2, <utf-8>: 1), ...``."""
        by = ", ".join(f"{k}: {v}" for k, v in sorted(self.malformed_by_column.items()))
        return (f"read {self.rows} rows, skipped {self.malformed} malformed" + (f" ({by})" if by else "")
                + f", {self.duplicates} duplicates, {self.too_long} over max_prompt_len, kept {self.kept}")


@dataclasses.dataclass(kw_only=True)
class PromptDataset:
    """Tokenized prompt records and the counts of how they were obtained."""

    records: list[PromptRecord]
    """Kept prompts, in file order."""
    stats: DatasetStats
    """Counts of rows read, skipped, de-duplicated and dropped."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def batches(self, batch_size: int, *, seed: int, epoch: int) -> Iterator[list[PromptRecord]]:
        """Shuffled full batches of one epoch; the order depends only on ``(seed, epoch)``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = list(range(len(self.records)))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [self.records[i] for i in order[start : start + batch_size]]


def _ground_truth(value: Any, path: Path, row: int) -> str:
    if not isinstance(value, dict):
        why = f"expected a struct/dict, got {type(value).__name__}"
        raise DatasetFormatError(path, row, "reward_model", why)
    if value.get("ground_truth") is None:
        raise DatasetFormatError(path, row, "reward_model.ground_truth", "missing ground truth")
    gt = value["ground_truth"]
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
        why = f"expected a string, got {type(gt).__name__}"
        raise DatasetFormatError(path, row, "reward_model.ground_truth", why)
    if isinstance(gt, str) and not gt.strip():  # a verifier must never match an empty answer
        raise DatasetFormatError(path, row, "reward_model.ground_truth", f"blank ground truth {gt!r}")
    if isinstance(gt, float):
        if not math.isfinite(gt):
            raise DatasetFormatError(path, row, "reward_model.ground_truth", f"not a finite number: {gt}")
        if gt.is_integer():  # a float column stores 42 as 42.0; "Answer: 42" must match it
            return str(int(gt))
    return str(gt)


def _messages(value: Any, path: Path, row: int) -> tuple[ChatMessage, ...]:
    if isinstance(value, str):
        return (ChatMessage(role="user", content=value),)
    if not isinstance(value, (list, tuple)) or not value:
        why = f"expected a non-empty list of messages, got {value!r:.60}"
        raise DatasetFormatError(path, row, "prompt", why)
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            why = f"message {j} is not {{'role': str, 'content': str}}: {m!r:.60}"
            raise DatasetFormatError(path, row, "prompt", why)
        if m["role"] not in ROLES:
            why = f"message {j} has role {m['role']!r:.40}; valid roles: {list(ROLES)}"
            raise DatasetFormatError(path, row, "prompt", why)
        out.append(ChatMessage(role=m["role"], content=m["content"]))
    return tuple(out)


def parse_row(
    raw: dict[str, Any], *, path: Path, row: int, default_data_source: str | None, file_index: int = 0
) -> PromptRecord:
    """Validate one raw row and turn it into a (not yet tokenized) ``PromptRecord``.

    ``file_index`` is the file's position in the list being read; it makes the uid unique.
    """
    source = raw.get("data_source")
    source = default_data_source if source is None else source  # absent or null
    if source is None:
        raise DatasetFormatError(path, row, "data_source", "missing (and no default_data_source given)")
    if not isinstance(source, str) or not source:
        raise DatasetFormatError(path, row, "data_source", f"expected a non-empty string, got {source!r:.60}")
    if source not in VERIFIER_BY_DATA_SOURCE:  # refused here, not at the first reward of a run
        why = f"unknown data source {source!r:.60}; registered: {VERIFIER_BY_DATA_SOURCE.names()}"
        raise DatasetFormatError(path, row, "data_source", why)
    extra = raw.get("extra_info")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        why = f"expected a struct/dict or null, got {type(extra).__name__}"
        raise DatasetFormatError(path, row, "extra_info", why)
    return PromptRecord(
        uid=f"{file_index}:{path.name}:{row}",
        data_source=source,
        messages=_messages(raw.get("prompt"), path, row),
        ground_truth=_ground_truth(raw.get("reward_model"), path, row),
        extra_info=extra,
    )


def _raw_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | DatasetFormatError]]:
    """``(row index, raw dict)`` of a parquet or jsonl file; unreadable json lines yield an error."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        import pyarrow as pa

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise DatasetFormatError(path, None, "<file>", f"not a readable parquet file ({exc})") from None
        names = pf.schema_arrow.names
        for col in REQUIRED_COLUMNS:
            if col not in names:
                raise DatasetFormatError(path, None, col, f"column missing from the file (has {names})")
        row = 0
        for batch in pf.iter_batches(batch_size=8192):  # the 1.8M-row DAPO file never sits in memory whole
            for raw in batch.to_pylist():
                yield row, raw
                row += 1
    elif path.suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            for row, raw_line in enumerate(f):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    why = f"not valid UTF-8 (byte 0x{raw_line[exc.start]:02x} at column {exc.start})"
                    yield row, DatasetFormatError(path, row, "<utf-8>", why)
                    continue
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield row, DatasetFormatError(path, row, "<json>", f"not valid JSON ({exc.msg})")
                    continue
                if not isinstance(raw, dict):
                    raw = DatasetFormatError(path, row, "<json>", "not a JSON object")
                yield row, raw
    else:
        raise ValueError(f"{path}: unsupported dataset format {path.suffix!r}; use .parquet or .jsonl")


def read_records(
    paths: Sequence[str | Path], *, dedupe: bool = True, skip_malformed: bool = False,
    default_data_source: str | None = None, stats: DatasetStats | None = None,
) -> tuple[list[PromptRecord], DatasetStats]:
    """Rows of all files as records, validated and (optionally) de-duplicated; not tokenized."""
    stats = stats or DatasetStats()
    seen: set[tuple] = set()
    records = []
    uids: set[str] = set()
    for file_index, path in enumerate(map(Path, paths)):
        for row, raw in _raw_rows(path):
            stats.rows += 1
            try:
                if isinstance(raw, DatasetFormatError):
                    raise raw
                rec = parse_row(
                    raw, path=path, row=row, default_data_source=default_data_source, file_index=file_index
                )
            except DatasetFormatError as exc:
                if not skip_malformed:
                    raise
                stats.malformed += 1
                stats.malformed_by_column[exc.column] = stats.malformed_by_column.get(exc.column, 0) + 1
                continue
            key = (rec.data_source, rec.messages, rec.ground_truth)
            if dedupe and key in seen:
                stats.duplicates += 1
                continue
            seen.add(key)
            if rec.uid in uids:  # cannot happen (file index + row); a record store keyed by uid relies on it
                raise AssertionError(f"duplicate prompt uid {rec.uid!r}")
            uids.add(rec.uid)
            records.append(rec)
    if not records:
        raise EmptyDatasetError(f"no prompts in {[str(p) for p in paths]}: {stats.summary()}")
    return records, stats


def tokenize_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template (with generation prompt) and encode."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_prompt_dataset(
    paths: Sequence[str | Path], *, tokenizer: Any, max_prompt_len: int, dedupe: bool = True,
    skip_malformed: bool = False, default_data_source: str | None = None,
) -> PromptDataset:
    """Read, validate, de-duplicate, template, tokenize and length-filter prompt files (see module doc)."""
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    records, stats = read_records(
        paths, dedupe=dedupe, skip_malformed=skip_malformed, default_data_source=default_data_source
    )
    kept = []
    for rec in records:
        ids = tokenize_prompt(tokenizer, rec.chat())
        if len(ids) > max_prompt_len:
            stats.too_long += 1
            continue
        kept.append(dataclasses.replace(rec, prompt_ids=tuple(ids)))
    stats.kept = len(kept)
    if not kept:
        raise EmptyDatasetError(f"no prompts in {[str(p) for p in paths]}: {stats.summary()}")
    return PromptDataset(records=kept, stats=stats)
