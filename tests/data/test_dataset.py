"""DAPO-schema datasets: parquet and jsonl, de-duplication, chat template, length filter, bad rows."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_credit.data.dataset import (
    DatasetFormatError,
    load_prompt_dataset,
    read_records,
    tokenize_prompt,
)
from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_arith_tokenizer(ArithTokenizerConfig(cache_dir=str(tmp_path_factory.mktemp("tok"))))


def _row(q, gt, source="math_dapo", index=0):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": q}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule-lean"},
        "extra_info": {"index": str(index)},
    }


def _dapo_rows():
    """Five distinct prompts, each repeated like the public file (which repeats ~100x)."""
    base = [_row(f"{a}+{a}=", str(2 * a)) for a in range(5)]
    base.append(_row("9" * 40 + "+1=", "1" + "0" * 40))  # long prompt, dropped by max_prompt_len
    return [dict(r, extra_info={"index": str(k)}) for k in range(7) for r in base]


def _write_parquet(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_parquet_dedupe_template_and_length_filter(tmp_path, tok):
    path = tmp_path / "dapo.parquet"
    _write_parquet(path, _dapo_rows())
    ds = load_prompt_dataset([path], tokenizer=tok, max_prompt_len=20)
    s = ds.stats
    assert (s.rows, s.duplicates, s.too_long, s.malformed, s.kept) == (42, 36, 1, 0, 5)
    assert len(ds) == 5
    for a, rec in enumerate(ds.records):
        assert rec.data_source == "math_dapo" and rec.ground_truth == str(2 * a)
        assert rec.messages[0].role == "user" and rec.messages[0].content == f"{a}+{a}="
        assert rec.extra_info == {"index": "0"}  # the first occurrence is kept
        assert rec.uid == f"0:dapo.parquet:{a}"
        want = tok.encode(f"<|user|>{a}+{a}=<|assistant|>Answer:")
        assert list(rec.prompt_ids) == want == tokenize_prompt(tok, rec.chat())
    # Without de-duplication every row stays (and the long one is still dropped).
    ds_all = load_prompt_dataset([path], tokenizer=tok, max_prompt_len=20, dedupe=False)
    assert ds_all.stats.kept == 35 and ds_all.stats.too_long == 7 and ds_all.stats.duplicates == 0


def test_jsonl_matches_parquet_and_accepts_plain_prompts(tmp_path, tok):
    rows = _dapo_rows()
    pq_path, js_path = tmp_path / "d.parquet", tmp_path / "d.jsonl"
    _write_parquet(pq_path, rows)
    js_path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a = load_prompt_dataset([pq_path], tokenizer=tok, max_prompt_len=64)
    b = load_prompt_dataset([js_path], tokenizer=tok, max_prompt_len=64)
    assert [(r.messages, r.ground_truth, r.prompt_ids) for r in a.records] == [
        (r.messages, r.ground_truth, r.prompt_ids) for r in b.records
    ]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "2+2=", "reward_model": {"ground_truth": 4}}) + "\n")
    with pytest.raises(DatasetFormatError, match="row 0, column 'data_source'"):
        read_records([plain])
    recs, _ = read_records([plain], default_data_source="synthetic_arith")
    assert recs[0].ground_truth == "4" and recs[0].data_source == "synthetic_arith"
    # Two files: duplicates across files are dropped too.
    both = load_prompt_dataset([pq_path, js_path], tokenizer=tok, max_prompt_len=64)
    assert both.stats.rows == 84 and both.stats.kept == 6


@pytest.mark.parametrize(
    "bad,column,why",
    [
        ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth", "missing ground truth"),
        ({"reward_model": {"ground_truth": None}}, "reward_model.ground_truth", "missing ground truth"),
        ({"reward_model": {"ground_truth": [1, 2]}}, "reward_model.ground_truth", "expected a string"),
        ({"reward_model": "42"}, "reward_model", "expected a struct"),
        ({"prompt": 17}, "prompt", "expected a non-empty list"),
        ({"prompt": []}, "prompt", "expected a non-empty list"),
        ({"prompt": [{"role": "user"}]}, "prompt", "message 0"),
        ({"data_source": 3}, "data_source", "non-empty string"),
        ({"extra_info": [1]}, "extra_info", "struct/dict"),
    ],
)
def test_malformed_jsonl_row_names_file_row_and_column(tmp_path, tok, bad, column, why):
    rows = [_row("1+1=", "2"), _row("2+2=", "4"), dict(_row("3+3=", "6"), **bad), _row("4+4=", "8")]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetFormatError) as err:
        load_prompt_dataset([path], tokenizer=tok, max_prompt_len=64)
    msg = str(err.value)
    assert str(path) in msg and "row 2" in msg and f"column '{column}'" in msg and why in msg
    assert (err.value.row, err.value.column) == (2, column)
    ds = load_prompt_dataset([path], tokenizer=tok, max_prompt_len=64, skip_malformed=True)
    assert ds.stats.malformed == 1 and ds.stats.kept == 3
    assert [r.ground_truth for r in ds.records] == ["2", "4", "8"]


def test_malformed_parquet_rows(tmp_path, tok):
    # Row 3 has no ground truth (a null in the struct column).
    rows = [_row(f"{a}+1=", str(a + 1)) for a in range(5)]
    rows[3] = dict(rows[3], reward_model={"ground_truth": None, "style": "rule"})
    path = tmp_path / "nogt.parquet"
    _write_parquet(path, rows)
    where = r"nogt\.parquet, row 3, column 'reward_model\.ground_truth'"
    with pytest.raises(DatasetFormatError, match=where):
        load_prompt_dataset([path], tokenizer=tok, max_prompt_len=64)
    skipped = load_prompt_dataset([path], tokenizer=tok, max_prompt_len=64, skip_malformed=True)
    assert skipped.stats.malformed == 1 and skipped.stats.kept == 4
    # Wrong column type for the whole file: prompt stored as an integer column.
    path2 = tmp_path / "wrongtype.parquet"
    columns = {"data_source": ["math"] * 2, "prompt": [1, 2], "reward_model": [{"ground_truth": "1"}] * 2}
    pq.write_table(pa.table(columns), path2)
    with pytest.raises(DatasetFormatError, match=r"wrongtype\.parquet, row 0, column 'prompt'"):
        read_records([path2])
    # A required column missing from the file.
    path3 = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"data_source": ["math"], "prompt": [[{"role": "user", "content": "q"}]]}), path3)
    with pytest.raises(DatasetFormatError, match=r"nocol\.parquet, column 'reward_model': column missing"):
        read_records([path3])


def test_bad_json_line_and_unsupported_suffix(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(_row("1+1=", "2")) + "\n{not json\n")
    with pytest.raises(DatasetFormatError, match=r"broken\.jsonl, row 1, column '<json>'"):
        read_records([path])
    recs, stats = read_records([path], skip_malformed=True)
    assert len(recs) == 1 and stats.malformed == 1
    with pytest.raises(ValueError, match="unsupported dataset format"):
        read_records([tmp_path / "x.csv"])


def test_batches_are_deterministic_per_epoch(tmp_path, tok):
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(_row(f"{a}+1=", str(a + 1))) for a in range(23)))
    ds = load_prompt_dataset([path], tokenizer=tok, max_prompt_len=64)
    e0 = [[r.uid for r in b] for b in ds.batches(5, seed=1, epoch=0)]
    assert len(e0) == 4 and all(len(b) == 5 for b in e0)  # the last partial batch is dropped
    assert e0 == [[r.uid for r in b] for b in ds.batches(5, seed=1, epoch=0)]
    assert e0 != [[r.uid for r in b] for b in ds.batches(5, seed=1, epoch=1)]
    assert len({u for b in e0 for u in b}) == 20


def test_transformers_tokenizer_chat_template(tmp_path):
    """A Hugging Face tokenizer works through the same path; its template writes the BOS once."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789+=:|<> "
    vocab = {"[UNK]": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="[UNK]")
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(_row("1+1=", "2")) + "\n" + json.dumps(_row("x" * 30 + "=", "2")) + "\n")
    ds = load_prompt_dataset([path], tokenizer=hf, max_prompt_len=30)
    assert ds.stats.kept == 1 and ds.stats.too_long == 1
    ids = list(ds.records[0].prompt_ids)
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids[1:] == [vocab[c] for c in "<|user|>1+1=<|assistant|>"]


def test_same_named_files_in_different_folders_get_distinct_uids(tmp_path):
    paths = []
    for folder, q in [("a", "1+1="), ("b", "2+2=")]:
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "train.jsonl")
        paths[-1].write_text(json.dumps(_row(q, "2")) + "\n")
    records, stats = read_records(paths)
    assert stats.kept == 0 and len(records) == 2  # read_records does not tokenize: kept stays 0
    assert [r.uid for r in records] == ["0:train.jsonl:0", "1:train.jsonl:0"]


def test_integral_float_ground_truths_become_integer_strings(tmp_path):
    path = tmp_path / "floats.parquet"
    rows = [_row("a", 42.0), _row("b", 0.5), _row("c", 7)]
    rows[2]["reward_model"]["ground_truth"] = 7.0
    _write_parquet(path, rows)
    records, _ = read_records([path])
    assert [r.ground_truth for r in records] == ["42", "0.5", "7"]
    bad = tmp_path / "nan.jsonl"
    bad.write_text(json.dumps(_row("a", 1)).replace('"ground_truth": 1', '"ground_truth": NaN') + "\n")
    with pytest.raises(DatasetFormatError, match=r"nan\.jsonl, row 0, column 'reward_model.ground_truth'"):
        read_records([bad])
