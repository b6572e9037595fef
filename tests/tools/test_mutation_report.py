"""tools/mutation_report.py on a fabricated mutmut 3 result tree (``mutants/<source>.py.meta``).

The report must count only failing tests as kills: timeouts, crashes and unknown exit codes are shown
on their own and listed, equivalents leave the denominator only while they survive.
"""
from __future__ import annotations

import json

import pytest

from tools import mutation_report as mr

from tests.support.paths import ROOT
from tests.support.runs import subprocess_env

MOD = "megatron_credit.credit.scan"


def _write_meta_files(root, codes_by_path):
    for path, codes in codes_by_path.items():
        meta = root / (path + ".meta")
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))


@pytest.fixture
def mutmut_run(tmp_path):
    scan = {f"{MOD}.x_f__mutmut_{i}": code for i, code in enumerate(
        [1, 1, 3, 37, 0, 0, 36, -24, 255, -11, -9, 99, 33, 5, None, 34], start=1)}
    gae = {"megatron_credit.credit.gae.x_gae__mutmut_1": 1,
           "megatron_credit.credit.gae.x_gae__mutmut_2": None}
    _write_meta_files(tmp_path / "mutants", {"megatron_credit/credit/scan.py": scan,
                                             "megatron_credit/credit/gae.py": gae,
                                             "megatron_credit/credit/gates.py": {}})
    eq = tmp_path / "equivalents.md"
    # _5 survives (a true equivalent), _1 is killed (a stale row); a name in prose is not a row.
    eq.write_text(f"| mutant | change | why |\n| --- | --- | --- |\n| `{MOD}.x_f__mutmut_5` | a | b |\n"
                  f"| `{MOD}.x_f__mutmut_1` | a | b |\nprose `{MOD}.x_f__mutmut_6`\n")
    return tmp_path / "mutants", eq


def test_load_and_score_counts_timeouts_apart(mutmut_run):
    mutants, eq = mutmut_run
    results = mr.load_results(mutants)
    assert sorted(results) == ["megatron_credit/credit/gae.py", "megatron_credit/credit/scan.py"]
    equivalent = mr.equivalent_names(eq)
    assert equivalent == {f"{MOD}.x_f__mutmut_5", f"{MOD}.x_f__mutmut_1"}
    s = mr.score_module("scan", results["megatron_credit/credit/scan.py"], equivalent)
    # 16 mutants, 2 without a verdict (not checked, skipped).
    assert s.verdicts == 14
    assert (s.killed, s.timeout, s.suspicious, s.no_tests, s.survived, s.equivalent) == (4, 3, 3, 2, 1, 1)
    assert s.score == pytest.approx(4 / 13)
    assert s.names["timeout"] == [f"{MOD}.x_f__mutmut_{i}" for i in (7, 8, 9)]
    assert s.names["suspicious"] == [f"{MOD}.x_f__mutmut_{i}" for i in (10, 11, 12)]
    assert s.names["survived"] == [f"{MOD}.x_f__mutmut_6"]
    assert s.names["no tests"] == [f"{MOD}.x_f__mutmut_{i}" for i in (13, 14)]
    assert s.stale_equivalents == [f"{MOD}.x_f__mutmut_1  (killed)"]


def test_all_timeouts_score_zero_not_hundred(tmp_path):
    _write_meta_files(tmp_path, {"m.py": {"m.x_f__mutmut_1": 36, "m.x_f__mutmut_2": -24}})
    s = mr.score_module("m.py", mr.load_results(tmp_path)["m.py"], set())
    assert (s.killed, s.timeout, s.score) == (0, 2, 0.0)
    assert mr.score_module("m.py", {"m.x_f__mutmut_1": None}, set()).score is None


def test_main_prints_scores_and_lists(mutmut_run, capsys):
    mutants, eq = mutmut_run
    assert mr.main(["--mutants", str(mutants), "--equivalents", str(eq)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("megatron", "TOTAL"))}
    # mutants killed timeout suspicious no-tests survived equiv score
    assert rows["megatron_credit/credit/scan.py"] == ["14", "4", "3", "3", "2", "1", "1", "30.8%"]
    assert rows["megatron_credit/credit/gae.py"] == ["1", "1", "0", "0", "0", "0", "0", "100.0%"]
    assert rows["TOTAL"] == ["15", "5", "3", "3", "2", "1", "1", "35.7%"]
    assert "3 timeout" in out and f"  {MOD}.x_f__mutmut_9" in out
    assert "3 suspicious" in out and "1 survived" in out and "2 no tests" in out
    assert f"  {MOD}.x_f  (2 mutants)" in out  # no-tests mutants are listed per function
    assert "not surviving" in out and f"{MOD}.x_f__mutmut_1  (killed)" in out
    assert "megatron_credit/credit/gates.py" not in out


def test_main_without_results(tmp_path, capsys):
    assert mr.main(["--mutants", str(tmp_path / "none")]) == 0
    assert "no mutmut results" in capsys.readouterr().out


@pytest.mark.spawn
def test_under_mutmut_a_test_that_hangs_fails_within_the_short_timeout(tmp_path):
    # tests/conftest.py under MUTANT_UNDER_TEST: a never-ending loop (what a mutated loop bound does) fails
    # its test after MUTATION_TEST_TIMEOUT_S, so mutmut records a kill instead of waiting for its CPU limit.
    import os
    import shutil
    import subprocess
    import sys
    import time

    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_hang.py").write_text("def test_fast():\n    assert True\n\n"
                                           "def test_hangs():\n    while True:\n        pass\n")
    # the copied conftest imports tests.support (its process guard): the repository goes on PYTHONPATH
    env = dict(subprocess_env(), MUTANT_UNDER_TEST="megatron_credit.credit.scan.x__doubling__mutmut_1",
               MUTATION_TEST_TIMEOUT_S="2")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "1 failed, 1 passed" in proc.stdout and "Timeout" in proc.stdout
    assert time.perf_counter() - t0 < 60
