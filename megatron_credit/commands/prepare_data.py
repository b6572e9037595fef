"""Prompt files of the cluster recipes (``data.train_path``, ``data.val_path``): download, check, write.

    mc-prepare-data --out /data                          # both datasets, from the Hugging Face hub
    mc-prepare-data --out /data --datasets aime-2024 --revision <commit>
    mc-prepare-data --out /data --from-local dapo-math-17k=/mnt/dapo-math-17k.parquet \\
        --from-local aime-2024=/mnt/aime-2024.parquet    # offline: files brought from a machine with internet
    mc-prepare-data --out /data --datasets my-set --from-local my-set=my_problems.jsonl   # a dataset of your own
    python tools/prepare_data.py --out /data             # the same, from a checkout

The sources (:data:`SOURCES`, the files verl's DAPO recipe downloads): ``dapo-math-17k`` is
``BytedTsinghua-SIA/DAPO-Math-17k``'s ``data/dapo-math-17k.parquet`` (the training prompts) and
``aime-2024`` is ``BytedTsinghua-SIA/AIME-2024``'s ``data/aime-2024.parquet`` (the validation prompts),
fetched with ``huggingface_hub.hf_hub_download`` (into its cache; ``--revision`` pins a commit).
``--from-local NAME=PATH`` takes a parquet or jsonl file instead; a NAME outside the table is a dataset
of your own, written to ``NAME.parquet``.

Every file goes through the trainer's own reader (``megatron_credit.data.dataset.read_records``, the DAPO
schema of that module's docstring): each row is validated, a malformed row is dropped and counted by
the column that was wrong, a repeated prompt is dropped with the trainer's de-duplication key (the
public DAPO-Math-17K file holds each prompt about 100 times), and every kept row's ``data_source`` is
registered in ``rewards.base.VERIFIER_BY_DATA_SOURCE``. A file in a plain problem/answer schema (a ``problem`` or
``Problem`` and an ``answer`` or ``Answer`` column, as in other AIME 2024 copies on the hub) is first put
into the DAPO schema: one user message, the problem inside DAPO-Math-17K's own prompt (:data:`DAPO_PROMPT`),
data source ``math_dapo``, its other columns in ``extra_info``; its malformed rows are counted under its
own column names.

Written: ``OUT/<name>.parquet`` with the four columns ``data_source``, ``prompt``, ``reward_model``
(``{"ground_truth"}``) and ``extra_info``, in the order of the first occurrence of each prompt;
through a temporary file in OUT and a rename, so a file is there whole or not at all, and an existing
file is replaced only with ``--force``. Prints one line per dataset: the source, rows read, kept,
dropped (malformed by column, duplicates), the output and its size. User errors (an unknown dataset, a
missing file, a file with no usable row, no network): one ``error: ...`` line, exit 2. See
``docs/data.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from megatron_credit.data.dataset import DatasetStats, EmptyDatasetError, read_records
from megatron_credit.data.records import PromptRecord
from megatron_credit.rewards.base import VERIFIER_BY_DATA_SOURCE

if TYPE_CHECKING:
    import pyarrow as pa


@dataclasses.dataclass(frozen=True, kw_only=True)
class HubSource:
    """One dataset file on the Hugging Face hub."""

    repo_id: str
    """The dataset repository, e.g. ``"BytedTsinghua-SIA/AIME-2024"``."""
    filename: str
    """The file inside the repository."""
    output: str
    """The file name written under ``--out`` (what the recipes' launcher reads)."""
    about: str
    """What the dataset is, one line."""

    def url(self, revision: str | None) -> str:
        """``hf://datasets/<repo>[@<revision>]/<file>``: where the rows came from, for the printed line."""
        return f"hf://datasets/{self.repo_id}{'@' + revision if revision else ''}/{self.filename}"


SOURCES: dict[str, HubSource] = {
    "dapo-math-17k": HubSource(
        repo_id="BytedTsinghua-SIA/DAPO-Math-17k", filename="data/dapo-math-17k.parquet",
        output="dapo-math-17k.parquet",
        about="DAPO-Math-17K: DAPO's training prompts, math problems with integer answers"),
    "aime-2024": HubSource(
        repo_id="BytedTsinghua-SIA/AIME-2024", filename="data/aime-2024.parquet",
        output="aime-2024.parquet",
        about="AIME 2024 in DAPO's prompt format: DAPO's validation prompts"),
}
"""Dataset name -> where it comes from; adding a dataset is one entry."""

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
               'Remember to put your answer on its own line after "Answer:".')
"""DAPO-Math-17K's user message around a problem (the DAPO README's examples), for the problem/answer schema."""

PROBLEM_ANSWER_DATA_SOURCE = "math_dapo"
"""The data source of rows converted from the problem/answer schema: DAPO's ``Answer:`` verifier."""

PROBLEM_COLUMNS = ("problem", "Problem")
ANSWER_COLUMNS = ("answer", "Answer")
SUFFIXES = (".parquet", ".jsonl", ".json")
"""What ``read_records`` reads (``.json``: JSON lines, as there)."""
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One dataset to prepare."""

    name: str
    """The dataset's name (a key of :data:`SOURCES`, or a name of your own with a local file)."""
    output: Path
    """The parquet file to write."""
    local: Path | None
    """The ``--from-local`` file, or None: download ``source``."""
    source: HubSource | None
    """The hub file (None for a dataset of your own)."""


def build_parser() -> argparse.ArgumentParser:
    """The options (``main`` parses with it; the tests walk its actions)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder to write <name>.parquet into (created if missing)")
    p.add_argument("--datasets", default=",".join(SOURCES),
                   help=f"comma-separated dataset names (default: {','.join(SOURCES)})")
    p.add_argument("--from-local", action="append", default=[], metavar="NAME=PATH",
                   help="read dataset NAME from a local parquet / jsonl file instead of the hub (repeatable)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of the downloads")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    return p


def _local_files(items: list[str]) -> dict[str, Path]:
    """``--from-local NAME=PATH`` items as ``{NAME: PATH}``."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--from-local {item!r} is not of the form NAME=PATH")
        if name in out:
            raise ValueError(f"--from-local names {name!r} twice")
        out[name] = Path(path).expanduser()
    return out


def plan_jobs(datasets: str, from_local: list[str], out: Path, *, force: bool) -> list[Job]:
    """The jobs of the command line, every refusal raised before anything is downloaded or written."""
    names = list(dict.fromkeys(n.strip() for n in datasets.split(",") if n.strip()))
    if not names:
        raise ValueError(f"--datasets {datasets!r} names no dataset; known: {sorted(SOURCES)}")
    local = _local_files(from_local)
    strays = sorted(set(local) - set(names))
    if strays:
        raise ValueError(f"--from-local names {strays}, which --datasets {names} does not list")
    jobs = []
    for name in names:
        source, path = SOURCES.get(name), local.get(name)
        if source is None and path is None:
            raise ValueError(f"unknown dataset {name!r}; known: {sorted(SOURCES)} (a dataset of your own "
                             f"needs --from-local {name}=PATH)")
        if not DATASET_NAME.fullmatch(name):
            raise ValueError(f"dataset name {name!r} is not a file name (letters, digits, '.', '_', '-')")
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"--from-local {name}={path}: no such file")
        if path is not None and path.suffix not in SUFFIXES:
            raise ValueError(f"--from-local {name}={path}: unsupported format {path.suffix!r}; use {list(SUFFIXES)}")
        output = out / (source.output if source else f"{name}.parquet")
        if output.exists() and not force:
            raise FileExistsError(f"{output} exists; pass --force to replace it")
        jobs.append(Job(name=name, output=output, local=path, source=source))
    return jobs


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What a failed download raises: ``huggingface_hub``'s errors, ``OSError`` (no network, a full cache
    disk) and the HTTP client's transport errors (a timeout in the middle of a file)."""
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    errors: tuple[type[BaseException], ...] = (OSError, EntryNotFoundError, HfHubHTTPError)
    try:
        import httpx
    except ImportError:  # huggingface_hub before 1.0 uses requests, whose errors are OSErrors
        return errors
    return errors + (httpx.HTTPError,)


def download(name: str, source: HubSource, revision: str | None) -> Path:
    """The hub file, through ``huggingface_hub``'s cache; a failure is a ValueError naming ``--from-local``."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(source.repo_id, source.filename, repo_type="dataset", revision=revision))
    except _hub_errors() as exc:
        why = " ".join(str(exc).split())[:300]
        raise ValueError(f"could not download {source.url(revision)} ({type(exc).__name__}: {why}); if this "
                         f"machine cannot reach the hub, fetch the file elsewhere and pass --from-local {name}=PATH"
                         ) from None


def _columns(path: Path) -> set[str]:
    """Column names of a parquet file, or the keys of a jsonl file's first JSON object (empty if none)."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return set(pq.read_schema(path).names)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    with open(path, "rb") as f:
        for line in f:
            try:
                raw = json.loads(line)
            except ValueError:  # JSONDecodeError or UnicodeDecodeError: read_records counts the line
                continue
            if isinstance(raw, dict):
                return set(raw)
    return set()


def problem_answer_columns(path: Path) -> tuple[str, str] | None:
    """None for a file in the DAPO schema (a ``prompt`` column), else its ``(problem, answer)`` columns."""
    columns = _columns(path)
    if not columns or "prompt" in columns:
        return None
    problem = next((c for c in PROBLEM_COLUMNS if c in columns), None)
    answer = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if problem is None or answer is None:
        raise ValueError(f"{path}: neither the DAPO schema (a 'prompt' column) nor a problem/answer schema (one of "
                         f"{list(PROBLEM_COLUMNS)} and one of {list(ANSWER_COLUMNS)}); columns: {sorted(columns)}")
    return problem, answer


def problem_answer_row(raw: dict[str, Any], *, problem: str, answer: str) -> dict[str, Any]:
    """One problem/answer row in the DAPO schema; a blank or missing problem gives ``prompt: None``, so that
    the row parser refuses it.

    >>> row = problem_answer_row({"Problem": " Find 1+1. ", "Answer": 2, "ID": "x"}, problem="Problem", answer="Answer")
    >>> row["prompt"][0]["content"].splitlines()[2], row["reward_model"], row["extra_info"]
    ('Find 1+1.', {'ground_truth': 2}, {'ID': 'x'})
    """
    text = raw.get(problem)
    ok = isinstance(text, str) and text.strip()
    return {
        "data_source": PROBLEM_ANSWER_DATA_SOURCE,
        "prompt": [{"role": "user", "content": DAPO_PROMPT.format(problem=text.strip())}] if ok else None,
        "reward_model": {"ground_truth": raw.get(answer)},
        "extra_info": {k: v for k, v in raw.items() if k not in (problem, answer)} or None,
    }


def _converted_lines(path: Path, *, problem: str, answer: str) -> Iterator[bytes]:
    """The rows of a problem/answer file as DAPO-schema JSON lines, one per source row (same row indices);
    a jsonl line that is no JSON object passes unchanged, for ``read_records`` to count."""
    def line_of(raw: dict[str, Any]) -> bytes:  # default=str: dates and the like become text in extra_info
        return json.dumps(problem_answer_row(raw, problem=problem, answer=answer), default=str).encode() + b"\n"

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
            yield from map(line_of, batch.to_pylist())
        return
    with open(path, "rb") as f:
        for line in f:
            try:
                raw = json.loads(line)
            except ValueError:  # JSONDecodeError or UnicodeDecodeError
                raw = None
            if isinstance(raw, dict):
                yield line_of(raw)
            else:
                yield line if line.endswith(b"\n") else line + b"\n"


def read_dataset(path: Path, *, where: str, tmp_dir: Path) -> tuple[list[PromptRecord], DatasetStats]:
    """The kept records of one file (module docstring) and the counts; ``where`` names it in errors.

    Returns ``(records, stats)``: ``stats.kept == len(records)``; ``stats.malformed_by_column`` uses the
    source's column names.
    """
    columns = problem_answer_columns(path)
    renames: dict[str, str] = {}
    if columns is not None:
        problem, answer = columns
        converted = tmp_dir / "converted.jsonl"
        with open(converted, "wb") as f:
            f.writelines(_converted_lines(path, problem=problem, answer=answer))
        path, renames = converted, {"prompt": problem, "reward_model": answer, "reward_model.ground_truth": answer}
    stats = DatasetStats()
    try:
        records, _ = read_records([path], skip_malformed=True, stats=stats)
    except EmptyDatasetError:
        records = []
    by_column: dict[str, int] = {}
    for column, n in stats.malformed_by_column.items():
        by_column[renames.get(column, column)] = by_column.get(renames.get(column, column), 0) + n
    stats.malformed_by_column, stats.kept = by_column, len(records)
    if not records:
        raise ValueError(f"no usable row in {where}: {counts(stats)}")
    unregistered = sorted({r.data_source for r in records} - set(VERIFIER_BY_DATA_SOURCE.names()))
    assert not unregistered, f"the row parser let through unregistered data sources {unregistered}"
    return records, stats


def records_table(records: list[PromptRecord]) -> pa.Table:
    """The DAPO-schema ``pyarrow.Table`` of ``records`` (one row each, four columns)."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.table({
        "data_source": pa.array([r.data_source for r in records], pa.string()),
        "prompt": pa.array([r.chat() for r in records], pa.list_(message)),
        "reward_model": pa.array([{"ground_truth": r.ground_truth} for r in records],
                                 pa.struct([("ground_truth", pa.string())])),
        "extra_info": pa.array([r.extra_info or None for r in records]),
    })


def write_parquet(records: list[PromptRecord], dest: Path, *, force: bool) -> int:
    """Write ``records`` to ``dest`` through a temporary file in its folder and a rename; returns its size
    in bytes. An existing ``dest`` is replaced only with ``force``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = records_table(records)
    except pa.ArrowException as exc:  # extra_info dicts whose values disagree in type across rows
        raise ValueError(f"{dest}: the rows' extra_info cannot be one parquet column ({exc})") from None
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # created as any file (umask)
    try:
        pq.write_table(table, tmp)
        if dest.exists() and not force:
            raise FileExistsError(f"{dest} exists; pass --force to replace it")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest.stat().st_size


def format_size(n: int) -> str:
    """A byte count for people.

    >>> format_size(812), format_size(4_096), format_size(5_452_595)
    ('812 B', '4.0 KiB', '5.2 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def counts(stats: DatasetStats) -> str:
    """``read R rows, kept K, dropped D (malformed M: col n, ...; duplicates U)``."""
    by = ", ".join(f"{c} {n}" for c, n in sorted(stats.malformed_by_column.items()))
    dropped = stats.malformed + stats.duplicates
    return (f"read {stats.rows} rows, kept {stats.kept}, dropped {dropped} (malformed {stats.malformed}"
            + (f": {by}" if by else "") + f"; duplicates {stats.duplicates})")


def prepare(job: Job, *, revision: str | None, force: bool) -> str:
    """Read, check and write one dataset; returns its printed line."""
    path = job.local if job.local is not None else download(job.name, job.source, revision)
    where = str(job.local) if job.local is not None else job.source.url(revision)
    with tempfile.TemporaryDirectory(prefix=".mc-prepare-", dir=job.output.parent) as tmp:
        records, stats = read_dataset(path, where=f"{job.name} ({where})", tmp_dir=Path(tmp))
    size = write_parquet(records, job.output, force=force)
    return f"{job.name}: {where}: {counts(stats)} -> {job.output} ({format_size(size)})"


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    jobs = plan_jobs(args.datasets, args.from_local, out, force=args.force)
    out.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        print(prepare(job, revision=args.revision, force=args.force), flush=True)
    return 0


def main(argv=None) -> int:
    """User errors: one ``error: ...`` line, exit code 2 (``--debug``: the traceback)."""
    from megatron_credit.cli import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
