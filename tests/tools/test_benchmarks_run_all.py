"""`make bench` (benchmarks/run_all.py): every benchmark, what runs and how long, no harmless warnings."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import run_all  # noqa: E402


def test_every_benchmark_is_run_or_said_not_to_be():
    scripts = {f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and f != "run_all.py"}
    listed = [name for name, _ in run_all.BENCHMARKS]
    assert len(listed) == len(set(listed)) and set(listed) | set(run_all.NOT_RUN) == scripts
    assert "concentration.py" in listed and all(s > 0 for _, s in run_all.BENCHMARKS)


def test_the_plan_names_each_benchmark_and_the_total_time():
    lines = run_all.plan_lines([("a.py", 30.0), ("b.py", 150.0)])
    assert lines[0] == ("make bench: 2 benchmarks, about 3.0 min in all (as measured on 2 CPU cores "
                        "shared with other jobs; yours may differ)")
    assert lines[1:3] == ["  1. benchmarks/a.py (~30 s)", "  2. benchmarks/b.py (~2.5 min)"]
    assert lines[3].startswith("  not run: benchmarks/trl_grpo_peer.py: needs trl")


@pytest.mark.spawn
def test_the_filter_silences_megatron_s_cpu_warnings_in_child_processes():
    code = ("import warnings, megatron.core.optimizer, megatron.core.models.backends; warnings.warn('When using async "
            "grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1')")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    assert "Transformer Engine and Apex are not installed" in plain.stderr  # what make bench printed ~30 times
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONWARNINGS=run_all.harmless_warnings_filter()))
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_unknown_names_are_refused_and_list_runs_nothing(capsys):
    assert run_all.main(["--only", "nope"]) == 2
    assert "unknown benchmark(s) ['nope.py']" in capsys.readouterr().err
    assert run_all.main(["--only", "concentration,step_time", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("make bench: 2 benchmarks") and out[1] == (
        f"  1. benchmarks/concentration.py (~{run_all._minutes(dict(run_all.BENCHMARKS)['concentration.py'])})")
