"""The trainer with credit maps on (their default: with validation) writes a map and the ``credit/``
diagnostics for FIPO, CompPO and GRPO: one tiny one-iteration run each."""
from __future__ import annotations

import html
import os

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.runs import train_tiny

pytestmark = pytest.mark.dist

pool = module_pool(1)

OWN = {"fipo": ["f_t", "future_kl", "estimator_advantage"], "comppo": ["kappa", "H", "transport", "value", "return"],
       "grpo": []}


@pytest.mark.parametrize("algorithm", ["fipo", "comppo", "grpo"])
def test_the_demo_with_maps_on_writes_pages_for_fipo_comppo_and_grpo(pool, tmp_path, algorithm):
    from megatron_credit.credit_maps.writer import map_path, read_records

    extra = ["algorithm.params.critic_layers=2"] if algorithm == "comppo" else []
    rows = pool.run(train_tiny, str(tmp_path), "none", [f"algorithm.name={algorithm}", "train.steps=1",
                                                        "train.val_every=1", *extra])[0]
    assert [r["step"] for r in rows] == [1] and "val/accuracy" in rows[0]
    records = read_records(map_path(str(tmp_path), 1, "jsonl"))
    assert len(records) == 4 and {r["correct"] for r in records} == {True, False}
    assert records[0]["chosen"] == "best of its group" and records[1]["chosen"] == "worst of its group"
    names = list(records[0]["fields"])
    assert names[0] == "advantage" and "logp_change" in names and all(n in names for n in OWN[algorithm])
    page = open(map_path(str(tmp_path), 1, "html"), encoding="utf-8").read()
    for rec in records:
        assert len(rec["tokens"]) == len(rec["fields"]["advantage"]) > 0
        assert html.escape(rec["prompt"]) in page
    m = rows[0]
    assert 0 <= m["credit/weight_gini"] < 1 and 0 < m["credit/effective_token_frac"] <= 1 + 1e-9
    assert -1 <= m["credit/position_corr"] <= 1 and m["time/credit_s"] < m["time/step_s"]
    if algorithm == "grpo":  # one advantage per response: equal credit on every token
        assert m["credit/weight_gini"] == pytest.approx(0, abs=1e-9)
        assert m["credit/effective_token_frac"] == pytest.approx(1, abs=1e-9) and m["credit/position_corr"] == 0
        assert all(len(set(r["fields"]["advantage"])) == 1 for r in records)
    if algorithm == "fipo":  # the applied credit is f_t A_t, as the map's own numbers say
        for r in records:
            f = r["fields"]
            assert f["advantage"] == pytest.approx([w * a for w, a in zip(f["f_t"], f["estimator_advantage"])],
                                                   abs=1e-5)
    assert sorted(os.listdir(tmp_path / "credit_maps")) == ["iter_0000001.html", "iter_0000001.jsonl"]
