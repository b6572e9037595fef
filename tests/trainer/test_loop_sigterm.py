"""SIGTERM (a pre-empted Slurm job: ``--signal=TERM@300``) makes the trainer save the iteration it is in and
exit cleanly; the same command then resumes from that checkpoint and continues the run's numbers.

The signal is sent once the run has written its first iteration; every rank agrees on the flag at the end
of each iteration (``trainer.loop._any_rank``), so the save happens at one iteration boundary.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_credit.run_layout import complete_checkpoints
from tests.support.paths import ROOT
from tests.support.runs import metrics_rows, subprocess_env

pytestmark = pytest.mark.dist

ARGS = ["warmup.steps=0", "train.val_every=0", "rollout.prompts_per_step=8", "rollout.n=4",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false", "algorithm.name=grpo",
        "checkpoint.every=0", "checkpoint.save_at_end=false"]


def _start(run_dir, steps):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--output-dir", str(run_dir),
                             f"train.steps={steps}", *ARGS], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_saves_the_current_iteration_and_the_same_command_resumes_from_it(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, steps=500)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no iteration within 300 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    saved = complete_checkpoints(str(run))
    assert len(saved) == 1, saved  # checkpoint.every=0 and save_at_end=false: only the SIGTERM save
    step = saved[0][0]
    assert f"SIGTERM: saved iteration {step}, exiting" in out
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, step + 1)) and step < 500

    resumed = _start(run, steps=step + 2)
    out2, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out2[-3000:]
    assert f"resumed from {saved[0][1]} (iteration {step})" in out2
    after = metrics_rows(run)
    assert [r["step"] for r in after] == list(range(1, step + 3))  # cut back to the checkpoint, then appended
    assert after[:step] == rows  # the rows before the signal are kept as they were
