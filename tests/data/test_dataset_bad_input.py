"""Bad input at the dataset and verifier surfaces: every row a user could hand us is refused with the
file, row and column named (or skipped and counted under ``skip_malformed``), no file yields a silently
empty dataset, and no verifier ever calls a response correct against a blank ground truth."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_credit.data.dataset import DatasetFormatError, EmptyDatasetError, read_records
from megatron_credit.rewards.base import VERIFIER_BY_DATA_SOURCE, REWARD_FNS


def _row(q="1+1=", gt="2", source="math_dapo", role="user"):
    return {"data_source": source, "prompt": [{"role": role, "content": q}], "reward_model": {"ground_truth": gt}}


def _jsonl(path, rows) -> None:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n")


# row -> (column, message): each is refused naming file, row 1 and the column
BAD_ROWS = {
    "not utf-8": (b'{"prompt": "caf\xe9"}\n', "<utf-8>", r"not valid UTF-8 \(byte 0xe9 at column 15\)"),
    "empty ground truth": (_row(gt=""), "reward_model.ground_truth", "blank ground truth ''"),
    "whitespace ground truth": (_row(gt=" \t"), "reward_model.ground_truth", r"blank ground truth ' \\t'"),
    "unknown data source": (_row(source="gsm8k"), "data_source",
                            r"unknown data source 'gsm8k'; registered: "
                            r"\['math', 'math_dapo', 'reasoning_gym', 'synthetic_arith', 'synthetic_chain'\]"),
    "unknown chat role": (_row(role="narrator"), "prompt",
                          r"message 0 has role 'narrator'; valid roles: \['system', 'user', 'assistant'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_jsonl_row_names_file_row_and_column(tmp_path, case):
    bad, column, message = BAD_ROWS[case]
    path = tmp_path / "data.jsonl"
    _jsonl(path, [_row("1+1="), bad, _row("2+2=", "4")])
    with pytest.raises(DatasetFormatError, match=message) as info:
        read_records([path])
    assert (info.value.path, info.value.row, info.value.column) == (str(path), 1, column)
    assert str(info.value).startswith(f"{path}, row 1, column '{column}': ")
    records, stats = read_records([path], skip_malformed=True)  # skippable and counted, by reason
    assert [r.ground_truth for r in records] == ["2", "4"]
    assert (stats.rows, stats.malformed, stats.malformed_by_column) == (3, 1, {column: 1})


def test_unknown_role_in_parquet_names_the_row(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([_row(), _row("3+3=", "6", role="tool_output")]), path)
    with pytest.raises(DatasetFormatError, match=f"{path}, row 1, column 'prompt': message 0 has role 'tool_output'"):
        read_records([path])


def test_zero_byte_parquet_names_the_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    with pytest.raises(DatasetFormatError, match=f"{path}, column '<file>': not a readable parquet file"):
        read_records([path])


EMPTY_CASES = {
    "empty file": ([], False, "read 0 rows, skipped 0 malformed, 0 duplicates, 0 over max_prompt_len, kept 0"),
    "blank lines only": ([b"\n", b"  \n"], False, "read 0 rows"),
    "every row skipped": ([_row(gt=""), _row(source="nope"), b"\xff\xfe\n", b"[1]\n"], True,
                          r"read 4 rows, skipped 4 malformed \(<json>: 1, <utf-8>: 1, data_source: 1, "
                          r"reward_model.ground_truth: 1\), 0 duplicates"),
}


@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_no_prompt_at_all_is_refused_with_the_counts(tmp_path, case):
    rows, skip, message = EMPTY_CASES[case]
    path = tmp_path / "data.jsonl"
    _jsonl(path, rows)
    with pytest.raises(EmptyDatasetError, match=message) as info:
        read_records([path], skip_malformed=skip)
    assert str(path) in str(info.value)


def test_everything_filtered_by_length_is_refused(tmp_path):
    from megatron_credit.data.dataset import load_prompt_dataset

    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[-1]["content"]

        def encode(self, text, add_special_tokens):
            return list(range(len(text)))

    path = tmp_path / "data.jsonl"
    _jsonl(path, [_row("1+1="), _row("22+22=", "44")])
    with pytest.raises(EmptyDatasetError, match="read 2 rows, .*, 2 over max_prompt_len, kept 0"):
        load_prompt_dataset([path], tokenizer=Tok(), max_prompt_len=3)


# --- verifiers against blank ground truths --------------------------------------------------------------
RESPONSES = ["Answer: dollars", "Answer: ", "", "\\boxed{}", "Answer: $", " 0", "Answer: 0"]


BLANK = [(m, g) for m in ("dapo", "math_verify", "synthetic_arith") for g in ("", " ", "\n\t")]
BLANK += [("dapo", "dollars"), ("dapo", "$")]  # blank after the DAPO (Minerva) normalisation


@pytest.mark.parametrize("method,ground_truth", BLANK)
def test_nothing_is_correct_against_a_blank_ground_truth(method, ground_truth):
    from megatron_credit.rewards.math import compute_score

    for response in RESPONSES:
        record = compute_score(response, ground_truth, method=method)
        assert (record.correct, record.score, record.status) == (False, -1.0, "bad_ground_truth"), (response, record)


def test_in_process_math_verify_timeout_is_reported(monkeypatch):
    import math_verify

    from megatron_credit.rewards.math import compute_score

    def slow_parse(*args, **kwargs):
        raise math_verify.errors.TimeoutException("Timeout during parsing")

    monkeypatch.setattr(math_verify, "parse", slow_parse)
    record = compute_score("\\boxed{2^{2^{40}}}", "1", method="math_verify")
    assert (record.correct, record.score, record.status) == (False, -1.0, "timeout")


@pytest.mark.spawn
def test_the_verifier_workers_module_alone_knows_the_builtin_methods():
    """A fresh interpreter that imports only ``rewards.verifier_workers`` resolves "dapo" (no workers needed)."""
    import subprocess
    import sys

    code = ("from megatron_credit.rewards.verifier_workers import _reference\n"
            "from megatron_credit.rewards.base import REWARD_FNS, method_for_data_source\n"
            "print(REWARD_FNS.names(), _reference('dapo', REWARD_FNS.get(method_for_data_source('math_dapo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['dapo', 'math_verify', 'reasoning_gym', 'synthetic_arith', 'synthetic_chain'] "
                           "('megatron_credit.rewards.dapo', 'score_dapo')")


def test_registries_are_what_the_tables_assume():
    assert VERIFIER_BY_DATA_SOURCE.names() == ["math", "math_dapo", "reasoning_gym", "synthetic_arith", "synthetic_chain"]
    assert set(REWARD_FNS.names()) >= {"dapo", "math_verify", "synthetic_arith"}
