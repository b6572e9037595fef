"""The credit testbed (``tools/credit_testbed.py``): its interval arithmetic against hand-computed values,
and a smoke run through the real trainer (files, a recorded failure, resumability, the wall-time budget)."""
import json
import math
import os
import subprocess
import sys

import pytest

from tools.testbed_stats import (curve_metrics, interaction_interval, interpolate, mean_interval, paired_interval,
                                 t_cdf, t_quantile)

from tests.support.paths import ROOT
from tests.support.runs import metrics_rows

# Two-sided 95% (and one 90% / 99%) Student-t critical values from printed tables.
T_TABLE = {(0.975, 1): 12.706, (0.975, 2): 4.303, (0.975, 3): 3.182, (0.975, 4): 2.776, (0.975, 5): 2.571,
           (0.975, 9): 2.262, (0.975, 19): 2.093, (0.975, 29): 2.045, (0.975, 120): 1.980, (0.95, 4): 2.132,
           (0.995, 4): 4.604, (0.995, 10): 3.169}


@pytest.mark.parametrize("key", sorted(T_TABLE))
def test_t_quantile_matches_tables(key):
    p, df = key
    assert abs(t_quantile(p, df) - T_TABLE[key]) < 6e-4
    assert abs(t_cdf(t_quantile(p, df), df) - p) < 1e-10 and t_quantile(1 - p, df) == -t_quantile(p, df)


def test_t_quantile_closed_forms():
    # df = 1 (Cauchy): tan(pi (p - 1/2)); df = 2: (2p - 1) sqrt(2 / (4p (1 - p))); df -> inf: the normal.
    for p in (0.6, 0.9, 0.975, 0.999):
        assert abs(t_quantile(p, 1) - math.tan(math.pi * (p - 0.5))) < 1e-8 * max(1, math.tan(math.pi * (p - 0.5)))
        assert abs(t_quantile(p, 2) - (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))) < 1e-9
    assert abs(t_quantile(0.975, 1e7) - 1.959964) < 1e-5
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_intervals_by_hand():
    # [0.2, 0.4, 0.3, 0.5, 0.6]: mean 0.4, s = sqrt(0.1 / 4) = 0.158114, half = 2.776445 * s / sqrt(5).
    iv = mean_interval([0.2, 0.4, 0.3, 0.5, 0.6])
    half = 2.7764451051977987 * math.sqrt(0.025) / math.sqrt(5)
    assert iv.n == 5 and abs(iv.mean - 0.4) < 1e-15 and abs(iv.lo - (0.4 - half)) < 1e-12
    assert abs(iv.hi - (0.4 + half)) < 1e-12 and abs(half - 0.196324) < 1e-6
    # Paired: differences over the common seeds only {1: 0.1, 2: 0.3, 3: -0.1}: mean 0.1, s = 0.2, t_2 = 4.302653.
    d = paired_interval({1: 0.5, 2: 0.7, 3: 0.3, 4: 9.0}, {1: 0.4, 2: 0.4, 3: 0.4, 5: 0.0})
    assert d.n == 3 and abs(d.mean - 0.1) < 1e-12 and abs(d.hi - (0.1 + 4.302652729749464 * 0.2 / math.sqrt(3))) < 1e-9
    # Interaction (a11 - a10) - (a01 - a00) per seed: seed 1: (5-3)-(2-1) = 1, seed 2: (6-3)-(2-2) = 3 -> mean 2,
    # s = sqrt(2), half = 12.706205 * sqrt(2) / sqrt(2).
    ia = interaction_interval([{1: 5, 2: 6}, {1: 3, 2: 3}, {1: 2, 2: 2}, {1: 1, 2: 2}])
    assert ia.mean == 2 and abs(ia.hi - 2 - 12.706204736174698) < 1e-9
    one, none = mean_interval([0.3]), mean_interval([])
    assert one.n == 1 and math.isnan(one.lo) and none.n == 0 and none.fmt() == "n/a"


def test_curve_summaries_by_hand():
    # Steps end at t = 2, 3, 7, 8, 10 s: AUC = (2*.1 + 1*.2 + 4*.3 + 1*.6 + 2*.5) / 10 = 0.32.
    m = curve_metrics([2, 3, 7, 8, 10], [0.1, 0.2, 0.3, 0.6, 0.5])
    assert m["final"] == 0.5 and m["last20"] == 0.5 and abs(m["auc"] - 0.32) < 1e-12
    assert curve_metrics([1] * 10, [0.0] * 8 + [0.4, 0.6])["last20"] == 0.5  # the last 2 of 10
    assert interpolate([1, 2], [5, 6], [0.5, 1.5, 2.5])[1:2] == [5.0]


def test_method_and_task_names():
    from tools.credit_testbed import method_overrides, task_overrides

    assert method_overrides("comppo:ppo_equiv")[1:3] == ["algorithm.params.gate_control=fixed",
                                                         "algorithm.params.fixed_gate=1.0"]
    assert method_overrides("ppo:lam=1.0") == ["algorithm.name=ppo", "algorithm.params.lam=1.0"]
    with pytest.raises(ValueError, match="unknown variant"):
        method_overrides("grpo:fixed")
    with pytest.raises(ValueError, match="unknown task"):
        task_overrides("chainsix")


TINY = ["model.architecture.hidden_size=32", "model.architecture.intermediate_size=64", "warmup.steps=4",
        "warmup.batch_size=8", "rollout.prompts_per_step=4", "rollout.n=4"]


def _testbed(out, *args):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "credit_testbed.py"), "--task", "chain3", "--out", str(out),
           "--doc", str(out / "doc.md"), "--jobs", "2", "--no-progress", *[f"--set={s}" for s in TINY], *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))


@pytest.mark.dist
def test_smoke_run_writes_results_records_failures_and_resumes(tmp_path):
    # grpo and fipo x 2 seeds x 2 iterations; "grpo:no_such_param=1" fails at recipe load (a failed cell).
    methods = "grpo,fipo,grpo:no_such_param=1"
    proc = _testbed(tmp_path, "--methods", methods, "--seeds", "2", "--steps", "2", "--budget-s", "600")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 to run" in proc.stdout and "| grpo | 2 |" in proc.stdout and "FIPO tau=32" in proc.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    task = report["tasks"]["chain3"]
    for m in ("grpo", "fipo"):
        for s in ("1", "2"):
            cell = task["cells"][m][s]
            assert cell["iterations"] == 2 and len(cell["accuracy"]) == 2 and 0 <= cell["auc"] <= 1
            assert cell["samples"] == [16, 32]
        row = task["table"][m]
        want = mean_interval([task["cells"][m][s]["final"] for s in ("1", "2")])
        assert row["final"]["n"] == 2 and row["final"]["mean"] == want.mean and row["final"]["hi"] == want.hi
    assert task["table"]["fipo"]["diff"]["auc"]["n"] == 2
    # FIPO's weight std is logged per iteration and the report takes its mean over the cell's iterations
    # (its value is checked in tests/trainer/test_step.py: 0 on the first mini-batch, > 0 after it).
    for s in ("1", "2"):
        rows = metrics_rows(tmp_path / f"cells/chain3/fipo/seed_{s}/run")
        stds = [r["fipo/weight_std"] for r in rows]
        assert len(stds) == 2 and all(x >= 0 for x in stds)
        assert task["cells"]["fipo"][s]["fipo_std"] == pytest.approx(sum(stds) / 2, abs=1e-15)
    assert "FIPO tau=32 (fipo): weight std per iteration" in proc.stdout
    assert set(task["failed"]["grpo:no_such_param=1"]) == {"1", "2"}
    assert "no_such_param" in task["failed"]["grpo:no_such_param=1"]["1"]["error"]
    for name in ("results.md", "doc.md", "chain3.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "python tools/credit_testbed.py" in (tmp_path / "doc.md").read_text()
    # One warm-up before the cells (warmup.seed fixed): every seed of every method starts from its cache.
    assert "warm-up: 4 steps" in (tmp_path / "warmup/chain3/log.txt").read_text()
    for m in ("grpo", "fipo"):
        for s in (1, 2):
            assert "warm-up: loaded from cache" in (tmp_path / f"cells/chain3/{m}/seed_{s}/log.txt").read_text()
    # Again with a third seed and a tiny budget: the 2 finished cells are skipped, and the new seed's cell
    # stops after one iteration (train.max_wall_s).
    proc = _testbed(tmp_path, "--methods", "grpo", "--seeds", "3", "--steps", "2", "--budget-s", "0.001")
    assert proc.returncode == 0 and "3 cells, 2 already finished, 1 to run" in proc.stdout, proc.stdout + proc.stderr
    task = json.loads((tmp_path / "results.json").read_text())["tasks"]["chain3"]
    assert task["cells"]["grpo"]["3"]["iterations"] == 1 and task["cells"]["grpo"]["1"]["iterations"] == 2
    assert task["table"]["grpo"]["final"]["n"] == 3
    assert "max_wall_s=0.001 reached after iteration 1" in (tmp_path / "cells/chain3/grpo/seed_3/log.txt").read_text()
    # A study past its deadline starts no cell; --report-only runs nothing and reports the finished cells:
    # fipo has seeds 1, 2 of 3 (seed 3 "not run", not a failure), grpo all three.
    proc = _testbed(tmp_path, "--methods", "grpo,fipo", "--seeds", "3", "--stop-after-s", "0")
    assert proc.returncode == 0 and "1 to run" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "cells/chain3/fipo/seed_3/cell.json").exists()
    proc = _testbed(tmp_path, "--methods", "grpo,fipo,dapo", "--seeds", "3", "--report-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| grpo | 3 |" in proc.stdout and "| fipo | 2 |" in proc.stdout and "| dapo |" not in proc.stdout
    assert "- not run: fipo seed 3" in proc.stdout and "- not run: dapo seeds 1, 2, 3" in proc.stdout
    assert "failed" not in proc.stdout
    assert json.loads((tmp_path / "results.json").read_text())["tasks"]["chain3"]["table"]["fipo"]["final"]["n"] == 2


def test_tool_doctests():
    # make test collects doctests of megatron_credit/ only; the testbed's examples run here.
    import doctest

    from tools import credit_testbed, testbed_methods, testbed_report, testbed_stats

    for module in (testbed_stats, testbed_methods, credit_testbed, testbed_report):
        assert doctest.testmod(module).failed == 0, module.__name__


@pytest.mark.spawn
def test_the_testbed_writes_into_the_repository_only_when_asked(tmp_path):
    # `--out runs/testbed` as the README shows it once rewrote the committed docs/results/ (--doc was
    # on by default). Now --doc is off unless given; `--doc` alone names the committed report.
    from tools.credit_testbed import DEFAULT_DOC, parse_args

    assert parse_args([]).doc is None
    assert parse_args(["--doc"]).doc == str(DEFAULT_DOC)
    assert parse_args(["--doc", "x.md"]).doc == "x.md"
    docs = DEFAULT_DOC.parent
    before = {p.name: p.read_bytes() for p in docs.iterdir()}
    cmd = [sys.executable, os.path.join(ROOT, "tools", "credit_testbed.py"), "--report-only", "--out",
           str(tmp_path), "--task", "chain3", "--methods", "grpo", "--seeds", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in docs.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain3.png", "results.json", "results.md"]
