"""``mc-prepare-data`` on small local files (no network): the rows it writes, the line it prints, the files it
keeps, and one ``error: ...`` line with exit 2 for each bad input. The hub is replaced by a function that
returns a local file (or raises), so the conversion that runs is the real one."""
from __future__ import annotations

import json
import re
from pathlib import Path

import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_credit.commands import prepare_data
from megatron_credit.commands.prepare_data import SOURCES, main
from megatron_credit.data.dataset import read_records
from megatron_credit.rewards.base import VERIFIER_BY_DATA_SOURCE

REPO = Path(__file__).resolve().parents[2]

PROMPT_OF_ONE_PLUS_ONE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nFind 1+1.\n\n"
    'Remember to put your answer on its own line after "Answer:".')
"""The DAPO-Math-17K user message around "Find 1+1.", written out in full to pin the template's wording."""


def _dapo(q: str, gt: str, *, source: str = "math_dapo", index: str) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "MATH",
            "reward_model": {"ground_truth": gt, "style": "rule"}, "extra_info": {"index": index}}


def _out(q: str, gt: str, index: str | None, source: str = "math_dapo") -> dict:
    """A row as the command writes it."""
    return {"data_source": source, "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": gt}, "extra_info": None if index is None else {"index": index}}


KEPT = [_out("What is 2+3?", "5", "a"), _out("What is 9-4?", "5", "f")]
"""What the command writes of ``dapo_parquet``: the first row of each prompt, rows with bad values left out."""


@pytest.fixture
def dapo_parquet(tmp_path) -> Path:
    """7 rows: 2 kept, 3 exact repeats of a prompt, a blank ground truth, an unknown data source."""
    rows = [_dapo("What is 2+3?", "5", index="a"), _dapo("What is 2+3?", "5", index="b"),
            _dapo("Half of 8?", " ", index="c"), _dapo("What is 7*6?", "42", source="gsm8k", index="d"),
            _dapo("What is 2+3?", "5", index="e"), _dapo("What is 9-4?", "5", index="f"),
            _dapo("What is 2+3?", "5", index="g")]
    path = tmp_path / "in" / "dapo.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_dapo_rows_are_checked_deduplicated_and_written(tmp_path, capsys, dapo_parquet):
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--datasets", "dapo-math-17k",
                                         "--from-local", f"dapo-math-17k={dapo_parquet}"])
    written = out / "dapo-math-17k.parquet"
    assert (code, stderr) == (0, "")
    assert _rows(written) == KEPT
    size = prepare_data.format_size(written.stat().st_size)
    assert stdout == (f"dapo-math-17k: {dapo_parquet}: read 7 rows, kept 2, dropped 5 (malformed 2: data_source 1, "
                      f"reward_model.ground_truth 1; duplicates 3) -> {written} ({size})\n")
    records, _ = read_records([written])  # strict: every written row is valid and unique
    assert [(r.data_source, r.chat(), r.ground_truth, r.extra_info) for r in records] == [
        ("math_dapo", [{"role": "user", "content": "What is 2+3?"}], "5", {"index": "a"}),
        ("math_dapo", [{"role": "user", "content": "What is 9-4?"}], "5", {"index": "f"})]
    assert all(r.data_source in VERIFIER_BY_DATA_SOURCE.names() for r in records)
    assert sorted(p.name for p in out.iterdir()) == ["dapo-math-17k.parquet"]  # no temporary file left


def test_problem_answer_jsonl_takes_the_dapo_prompt(tmp_path, capsys):
    lines = [json.dumps({"ID": "2024-I-1", "Problem": "  Find 1+1.  ", "Answer": 2, "Solution": "1+1=2"}),
             json.dumps({"ID": "2024-I-2", "Problem": "", "Answer": 5}),
             json.dumps({"ID": "2024-I-3", "Problem": "Find 2+2.", "Answer": None}),
             "not json",
             "",
             json.dumps({"ID": "2024-I-4", "Problem": "Find 1+1.", "Answer": 2.0}),
             json.dumps({"ID": "2024-I-5", "Problem": "Find 3+3.", "Answer": "6"})]
    src = tmp_path / "aime.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--datasets", "aime-2024",
                                         "--from-local", f"aime-2024={src}"])
    written = out / "aime-2024.parquet"
    assert (code, stderr) == (0, "")
    assert _rows(written) == [
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": PROMPT_OF_ONE_PLUS_ONE}],
         "reward_model": {"ground_truth": "2"}, "extra_info": {"ID": "2024-I-1", "Solution": "1+1=2"}},
        {"data_source": "math_dapo",
         "prompt": [{"role": "user", "content": PROMPT_OF_ONE_PLUS_ONE.replace("1+1", "3+3")}],
         "reward_model": {"ground_truth": "6"}, "extra_info": {"ID": "2024-I-5", "Solution": None}}]
    size = prepare_data.format_size(written.stat().st_size)
    assert stdout == (f"aime-2024: {src}: read 6 rows, kept 2, dropped 4 (malformed 3: <json> 1, Answer 1, "
                      f"Problem 1; duplicates 1) -> {written} ({size})\n")
    assert len(read_records([written])[0]) == 2


def test_problem_answer_parquet_with_integer_answers(tmp_path, capsys):
    src = tmp_path / "aime_2024_problems.parquet"
    rows = [{"ID": "2024-II-4", "Problem": "Find 1+1.", "Solution": "s", "Answer": 2},
            {"ID": "2024-II-5", "Problem": "Find 3+3.", "Solution": "t", "Answer": 6}]
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "data"
    argv = ["--out", str(out), "--datasets", "aime-2024", "--from-local", f"aime-2024={src}"]
    code, stdout, _ = _run(capsys, argv)
    assert code == 0 and "read 2 rows, kept 2, dropped 0 (malformed 0; duplicates 0)" in stdout
    written = _rows(out / "aime-2024.parquet")
    assert [(r["prompt"][0]["content"], r["reward_model"], r["extra_info"]) for r in written] == [
        (PROMPT_OF_ONE_PLUS_ONE, {"ground_truth": "2"}, {"ID": "2024-II-4", "Solution": "s"}),
        (PROMPT_OF_ONE_PLUS_ONE.replace("1+1", "3+3"), {"ground_truth": "6"}, {"ID": "2024-II-5", "Solution": "t"})]


def test_a_dataset_of_your_own_is_written_under_its_name(tmp_path, capsys, dapo_parquet):
    out = tmp_path / "data"
    argv = ["--out", str(out), "--datasets", "my-set", "--from-local", f"my-set={dapo_parquet}"]
    code, stdout, _ = _run(capsys, argv)
    assert code == 0 and stdout.startswith(f"my-set: {dapo_parquet}: read 7 rows, kept 2,")
    assert _rows(out / "my-set.parquet") == KEPT


def test_existing_output_is_kept_without_force(tmp_path, capsys, dapo_parquet):
    out = tmp_path / "data"
    out.mkdir()
    existing = out / "dapo-math-17k.parquet"
    existing.write_bytes(b"an earlier file")
    argv = ["--out", str(out), "--datasets", "dapo-math-17k", "--from-local", f"dapo-math-17k={dapo_parquet}"]
    code, stdout, stderr = _run(capsys, argv)
    assert (code, stdout) == (2, "")
    assert stderr == f"error: {existing} exists; pass --force to replace it\n"
    assert existing.read_bytes() == b"an earlier file"
    code, _, stderr = _run(capsys, argv + ["--force"])
    assert (code, stderr) == (0, "")
    assert _rows(existing) == KEPT
    assert sorted(p.name for p in out.iterdir()) == ["dapo-math-17k.parquet"]


def test_an_error_keeps_what_was_already_written(tmp_path, capsys, dapo_parquet):
    useless = tmp_path / "useless.jsonl"
    useless.write_text(json.dumps(_dapo("q", "", index="x")) + "\n", encoding="utf-8")
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--from-local", f"dapo-math-17k={dapo_parquet}",
                                         "--from-local", f"aime-2024={useless}"])
    assert code == 2 and stdout.startswith("dapo-math-17k: ")
    assert stderr == (f"error: no usable row in aime-2024 ({useless}): read 1 rows, kept 0, dropped 1 "
                      f"(malformed 1: reward_model.ground_truth 1; duplicates 0)\n")
    assert _rows(out / "dapo-math-17k.parquet") == KEPT
    assert sorted(p.name for p in out.iterdir()) == ["dapo-math-17k.parquet"]


def _bad_inputs(tmp_path: Path, dapo: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (arguments after --out, the expected error line); the files are written by the test."""
    missing = tmp_path / "missing.parquet"
    return {
        "unknown dataset": (["--datasets", "gsm8k"], "error: unknown dataset 'gsm8k'; known: ['aime-2024', "
                            "'dapo-math-17k'] (a dataset of your own needs --from-local gsm8k=PATH)"),
        "missing local file": (["--datasets", "aime-2024", "--from-local", f"aime-2024={missing}"],
                               f"error: --from-local aime-2024={missing}: no such file"),
        "no '='": (["--from-local", str(dapo)], f"error: --from-local '{dapo}' is not of the form NAME=PATH"),
        "name not among --datasets": (["--datasets", "aime-2024", "--from-local", f"dapo-math-17k={dapo}"],
                                      "error: --from-local names ['dapo-math-17k'], which --datasets "
                                      "['aime-2024'] does not list"),
        "no usable row": (["--datasets", "aime-2024", "--from-local", f"aime-2024={tmp_path / 'empty.jsonl'}"],
                          f"error: no usable row in aime-2024 ({tmp_path / 'empty.jsonl'}): read 0 rows, kept 0, "
                          "dropped 0 (malformed 0; duplicates 0)"),
        "unsupported format": (["--datasets", "aime-2024", "--from-local", f"aime-2024={tmp_path / 'notes.csv'}"],
                               f"error: --from-local aime-2024={tmp_path / 'notes.csv'}: unsupported format '.csv'; "
                               "use ['.parquet', '.jsonl', '.json']"),
        "unknown schema": (["--datasets", "aime-2024", "--from-local", f"aime-2024={tmp_path / 'other.jsonl'}"],
                           f"error: {tmp_path / 'other.jsonl'}: neither the DAPO schema (a 'prompt' column) nor a "
                           "problem/answer schema (one of ['problem', 'Problem'] and one of ['answer', 'Answer']); "
                           "columns: ['label', 'question']"),
        "no dataset": (["--datasets", " , "], "error: --datasets ' , ' names no dataset; known: ['aime-2024', "
                       "'dapo-math-17k']"),
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs(Path("/x"), Path("/y"))))
def test_bad_input_is_one_error_line(tmp_path, capsys, dapo_parquet, case):
    (tmp_path / "notes.csv").write_text("problem,answer\n", encoding="utf-8")
    (tmp_path / "other.jsonl").write_text(json.dumps({"question": "q", "label": "1"}) + "\n", encoding="utf-8")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    argv, line = _bad_inputs(tmp_path, dapo_parquet)[case]
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out)] + argv)
    assert (code, stdout, stderr) == (2, "", line + "\n")
    assert not out.exists() or list(out.iterdir()) == []  # refused before any folder or file is made


def test_hub_download_reads_the_recipes_files(tmp_path, capsys, monkeypatch, dapo_parquet):
    calls = []

    def fake_download(repo_id, filename, *, repo_type, revision):
        calls.append((repo_id, filename, repo_type, revision))
        return str(dapo_parquet)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--revision", "abc123"])
    assert (code, stderr) == (0, "")
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet", "dataset", "abc123"),
                     ("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet", "dataset", "abc123")]
    assert [line.split(" -> ")[0] for line in stdout.splitlines()] == [
        "dapo-math-17k: hf://datasets/BytedTsinghua-SIA/DAPO-Math-17k@abc123/data/dapo-math-17k.parquet: read 7 rows, "
        "kept 2, dropped 5 (malformed 2: data_source 1, reward_model.ground_truth 1; duplicates 3)",
        "aime-2024: hf://datasets/BytedTsinghua-SIA/AIME-2024@abc123/data/aime-2024.parquet: read 7 rows, "
        "kept 2, dropped 5 (malformed 2: data_source 1, reward_model.ground_truth 1; duplicates 3)"]
    assert _rows(out / "dapo-math-17k.parquet") == _rows(out / "aime-2024.parquet") == KEPT


def test_hub_failure_points_to_from_local(tmp_path, capsys, monkeypatch):
    def no_network(repo_id, filename, *, repo_type, revision):
        raise huggingface_hub.errors.LocalEntryNotFoundError("An error happened while trying to locate the file "
                                                              "on the Hub.\nPlease check your connection.")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--datasets", "aime-2024"])
    assert (code, stdout) == (2, "")
    assert stderr.count("\n") == 1
    assert stderr.startswith("error: could not download hf://datasets/BytedTsinghua-SIA/AIME-2024/data/aime-2024.parquet")
    assert "LocalEntryNotFoundError: An error happened while trying to locate the file on the Hub. Please" in stderr
    assert stderr.endswith("; if this machine cannot reach the hub, fetch the file elsewhere and pass "
                           "--from-local aime-2024=PATH\n")
    assert list(out.iterdir()) == []


def test_the_table_writes_what_the_launcher_reads():
    launcher = (REPO / "examples" / "launch" / "run_recipe.sh").read_text(encoding="utf-8")
    read = re.findall(r"\$\{DATA_DIR\}/([\w.-]+\.parquet)", launcher)
    assert sorted(read) == sorted(s.output for s in SOURCES.values())
    assert all(name == Path(s.output).stem for name, s in SOURCES.items())


def test_a_file_that_is_no_parquet_is_one_error_line(tmp_path, capsys):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not a parquet file")
    code, stdout, stderr = _run(capsys, ["--out", str(tmp_path / "data"), "--datasets", "aime-2024",
                                         "--from-local", f"aime-2024={junk}"])
    assert (code, stdout, stderr.count("\n")) == (2, "", 1)
    assert stderr.startswith(f"error: {junk}: not a readable parquet file (")


def test_extra_info_that_fits_no_column_is_one_error_line(tmp_path, capsys):
    src = tmp_path / "mixed.jsonl"
    rows = [dict(_dapo("a?", "1", index="x"), extra_info={"n": 1}),
            dict(_dapo("b?", "2", index="y"), extra_info={"n": "two"})]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "data"
    code, stdout, stderr = _run(capsys, ["--out", str(out), "--datasets", "mine", "--from-local", f"mine={src}"])
    assert (code, stdout, stderr.count("\n")) == (2, "", 1)
    assert stderr.startswith(f"error: {out / 'mine.parquet'}: the rows' extra_info cannot be one parquet column (")
    assert list(out.iterdir()) == []
