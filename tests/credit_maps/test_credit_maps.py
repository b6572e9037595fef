"""Credit maps (``credit_maps/writer.py``, ``credit_maps/page.py``) of a fixed batch: which responses,
their tokens in order with the batch's numbers, escaping of hostile token text, a page with nothing from the
network; and the tool that renders a page and a PNG from a run directory."""
from __future__ import annotations

import html
import json
import re

import pytest
import torch

from megatron_credit.credit_maps.writer import CreditMaps, map_path, read_records, select_rows
from tests.support.fixed_batch import _global_batch

HOSTILE = 77  # this token id decodes to markup


class _Tok:
    """Decodes id i to "t<i>", and HOSTILE to a script tag (a response may write anything)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join('<script>alert("x")</script>' if i == HOSTILE else f"t{i}" for i in ids)


def _batch_and_fields():
    batch = _global_batch()
    batch.labels[:, 10] = HOSTILE  # inside every response span
    g = torch.Generator().manual_seed(5)
    mask = batch.loss_mask
    fields = {"advantage": torch.where(mask, torch.randn(mask.shape, generator=g), 0.0),
              "f_t": torch.where(mask, 1 + 0.2 * torch.rand(mask.shape, generator=g), 1.0),
              "logp_change": torch.where(mask, 0.01 * torch.randn(mask.shape, generator=g), 0.0)}
    return batch, fields


def test_a_map_of_a_fixed_batch_holds_each_responses_tokens_in_order_with_the_batchs_numbers(tmp_path):
    batch, fields = _batch_and_fields()
    maps = CreditMaps(str(tmp_path), every=2, samples=4, tokenizer=_Tok(), algorithm="fipo")
    assert [maps.due(i) for i in (1, 2, 3, 4)] == [False, True, False, True]
    page = maps.write(2, batch, fields)
    assert page == map_path(str(tmp_path), 2, "html") and page.endswith("credit_maps/iter_0000002.html")
    records = read_records(map_path(str(tmp_path), 2, "jsonl"))
    assert len(records) == 4
    for rec in records:
        row = rec["row"]
        pos = batch.loss_mask[row].nonzero().flatten().tolist()
        assert rec["token_ids"] == batch.labels[row, pos].tolist()  # every scored token, in order
        assert rec["tokens"] == [_Tok().decode([i]) for i in rec["token_ids"]]
        assert rec["observation"] == [False] * len(pos)
        for name, v in fields.items():
            assert rec["fields"][name] == pytest.approx(v[row, pos].tolist(), abs=1e-6)
        assert rec["reward"] == float(batch.rewards[row]) and rec["correct"] == bool(batch.correct[row])
        assert rec["prompt"] == _Tok().decode(batch.input_ids[row, : pos[0] + 1].tolist())
    # the page: each response's tokens in order (escaped), one selector button per quantity
    text = open(page, encoding="utf-8").read()
    spans = re.findall(r'<span class="t[^"]*"[^>]*>(.*?)</span>', text)
    assert spans == [html.escape(t) for rec in records for t in rec["tokens"]]
    assert re.findall(r'<label for="q\d">(.*?)</label>', text) == ["advantage", "f_t", "logp_change"]
    first = records[0]
    assert f"advantage = {first['fields']['advantage'][0]:.4g}" in text  # the hover text holds the numbers


def test_hostile_token_text_is_escaped_and_the_page_loads_nothing():
    from megatron_credit.credit_maps.page import render_page

    batch, fields = _batch_and_fields()
    from megatron_credit.credit_maps.writer import response_records

    recs = response_records(batch, fields, [(0, "<b>why</b>")], tokenizer=_Tok(), iteration=1, algorithm="<i>x")
    recs[0]["prompt"] = "</pre><script>bad()</script>"
    text = render_page(recs, title="<script>t</script>")
    assert "<script" not in text.lower() and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    assert "<b>why</b>" not in text and "&lt;b&gt;why&lt;/b&gt;" in text
    assert not re.search(r"(src|href)\s*=|https?:|@import|url\(", text)  # nothing from the network


def test_the_chosen_responses_are_the_best_and_worst_of_a_group_and_both_outcomes():
    # group 0 all wrong, group 1 all right, group 2 mixed
    rewards = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 0.5])
    correct = rewards > 0
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    got = select_rows(rewards, correct, groups, 4)
    assert got[:2] == [(4, "best of its group"), (5, "worst of its group")]
    assert {bool(correct[i]) for i, _ in got} == {True, False} and len({i for i, _ in got}) == 4
    # a batch where no group is mixed still shows both outcomes
    got = select_rows(rewards[:4], correct[:4], groups[:4], 2)
    assert {bool(correct[i]) for i, _ in got} == {True, False}
    assert select_rows(rewards, correct, groups, 1) == [(4, "best of its group")]


def test_the_tool_renders_a_page_and_a_png_of_one_response(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_credit.commands.credit_map import main

    batch, fields = _batch_and_fields()
    for it in (2, 4):
        CreditMaps(str(tmp_path), every=2, samples=2, tokenizer=_Tok(), algorithm="fipo").write(it, batch, fields)
    out = tmp_path / "out.html"
    assert main(["--run", str(tmp_path), "--out", str(out), "--field", "f_t", "--sample", "1"]) == 0  # newest
    assert out.read_text(encoding="utf-8") == open(map_path(str(tmp_path), 4, "html"), encoding="utf-8").read()
    png = tmp_path / "out.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    every = tmp_path / "all.png"
    assert main(["--run", str(tmp_path), "--png", str(every), "--sample", "all"]) == 0
    assert every.stat().st_size > png.stat().st_size  # both responses
    with pytest.raises(SystemExit, match=r"--sample 2: the map of iteration 4 has 2 responses"):
        main(["--run", str(tmp_path), "--sample", "2"])
    with pytest.raises(SystemExit, match="no credit map of iteration 3"):
        main(["--run", str(tmp_path), "--iter", "3"])
    with pytest.raises(SystemExit, match=r"--field 'kappa': .*'advantage', 'f_t', 'logp_change'"):
        main(["--run", str(tmp_path), "--iter", "2", "--field", "kappa"])
    assert json.loads(open(map_path(str(tmp_path), 2, "jsonl")).readline())["iteration"] == 2
