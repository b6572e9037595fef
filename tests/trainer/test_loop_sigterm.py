"""An exit signal (``checkpoint.exit_signals``: SIGTERM, a pre-empted job; SIGUSR1, Slurm's warning ahead of the
time limit, ``--signal=USR1@<lead>``) makes the trainer save the iteration it is in and exit 0; the same command
then resumes from that checkpoint and continues the run's numbers, every step once.

The signal is sent once the run has written its first iteration; every rank agrees on it at the end of each
iteration (``trainer/stop.py``), so the save happens at one iteration boundary. SIGUSR1 is sent again and again
until the trainer says the save is done: the signals that arrive during the save change nothing. The run
has reward workers, and none of its processes is left afterwards (``tests/support/leftovers.py``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_credit.run_dir import complete_checkpoints
from tests.support.leftovers import marked_env, wait_until_none_left
from tests.support.paths import ROOT
from tests.support.runs import metrics_rows, subprocess_env

pytestmark = pytest.mark.dist

ARGS = ["warmup.steps=0", "train.val_every=0", "rollout.prompts_per_step=8", "rollout.n=4",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false", "algorithm.name=grpo",
        "checkpoint.every=0", "checkpoint.save_at_end=false", "reward.num_workers=1"]


def _start(run_dir, steps, env):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--output-dir", str(run_dir),
                             f"train.steps={steps}", *ARGS], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, lines, reader


def _signal_after_first_iteration(proc, lines, run, sig, *, repeat: bool) -> int:
    """Send ``sig`` once the first iteration is written; with ``repeat``, again every 50 ms until the trainer
    logs that the save is done. Returns how many were sent after it logged the stop (during the save)."""
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "no iteration within 300 s"
        time.sleep(0.2)
    proc.send_signal(sig)
    during = 0
    while repeat and proc.poll() is None and not any("saved iteration" in line for line in lines):
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.05)
        stopping = any("stopping after iteration" in line for line in lines)
        proc.send_signal(sig)
        during += stopping
    return during


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_an_exit_signal_saves_the_current_iteration_and_the_same_command_resumes_from_it(tmp_path, sig):
    run = tmp_path / "run"
    env, mark = marked_env(subprocess_env())
    proc, lines, reader = _start(run, 500, env)
    try:
        during = _signal_after_first_iteration(proc, lines, run, getattr(signal, sig), repeat=sig == "SIGUSR1")
        proc.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert wait_until_none_left(mark) == []  # the reward worker and the guard ended with the trainer
    saved = complete_checkpoints(str(run))
    assert len(saved) == 1, saved  # checkpoint.every=0 and save_at_end=false: only the signal's save
    assert os.listdir(run / "checkpoints") == [os.path.basename(saved[0][1])]  # no partial save left
    step = saved[0][0]
    assert f"{sig}: stopping after iteration {step}; saving it" in out
    assert f"{sig}: saved iteration {step}, exiting" in out
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, step + 1)) and step < 500
    if sig == "SIGTERM":
        return
    assert during >= 1, out[-3000:]  # signals sent after the stop was agreed: during the save or after it

    resumed, lines2, reader2 = _start(run, step + 2, env)
    resumed.wait(timeout=600)
    reader2.join(timeout=30)
    out2 = "".join(lines2)
    assert resumed.returncode == 0, out2[-3000:]
    assert f"resumed from {saved[0][1]} (iteration {step})" in out2
    after = metrics_rows(run)
    assert [r["step"] for r in after] == list(range(1, step + 3))  # cut back to the checkpoint, then appended
    assert after[:step] == rows  # the rows before the signal are kept as they were
    assert wait_until_none_left(mark) == []
