"""Device placement: the trainer on an emulated accelerator (``tests/support/fakegpu.py``) equals the CPU path.

Every tensor the trainer makes or moves must be on the device ``distributed.initialize`` returns, and
every collective must get device tensors (NCCL's contract): the emulated device raises, as CUDA does,
when an op mixes a non-scalar CPU tensor with a device one, and its collectives raise on CPU tensors.
Before the device path was fixed every scenario here failed (the built model stayed on the CPU: ``Expected
all tensors to be on the same device ... cpu, fakegpu:0! (in aten.mul.Tensor)`` at megatron's
``rope_utils.py``). Each scenario runs in processes of its own (the backend registration is
process-wide); the numbers must equal the CPU path's (the emulated device computes on the CPU).

- the update on the fixed batch of ``tests/support/fixed_batch.py`` (test_step's; behaviour pass,
  advantages, two optimizer steps) for GRPO, FIPO, PPO with a value head and with a separate critic, and CompPO
  (with the dynamic gate and with the ``position`` control, whose schedule is all-reduced over DP);
- ``pretrain_rl.py`` with the supervised warm-up, a frozen reference (KL), megatron's optimizer, the HF
  engine and its weight sync, a checkpoint every iteration and a resume;
- ``pretrain_rl.py`` under ``torchrun`` with TP = 2.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.distributed_harness import DistributedPool, _free_port
from tests.support.paths import ROOT
from tests.support.runs import VOLATILE, metrics_rows

LOCAL = ["model.transformer_impl=local"]  # the emulated machine has no Transformer Engine
pytestmark = [pytest.mark.slow, pytest.mark.dist]  # gloo pools, the trainer on the emulated device, torchrun


def _on_fake_device(fn, *args, **kwargs):
    """``fn`` inside the emulated one-GPU machine (runs in a pool worker)."""
    from tests.support.fakegpu import fake_cuda

    with fake_cuda():
        return fn(*args, **kwargs)


def _fixed_batch(algorithm: str, overrides: list[str], *, fake: bool):
    from tests.support.fixed_batch import _run_fixed

    with DistributedPool(world_size=1) as pool:  # a fresh process per scenario
        if fake:
            return pool.run(_on_fake_device, _run_fixed, {}, algorithm, overrides=overrides)[0]
        return pool.run(_run_fixed, {}, algorithm, overrides=overrides)[0]


SCENARIOS = {"grpo": ("grpo", []), "fipo": ("fipo", []), "ppo": ("ppo", []),
             "ppo:separate": ("ppo", ["algorithm.params.critic=separate"]),
             "comppo": ("comppo", ["algorithm.params.critic_layers=1"]),
             # the position control all-reduces its bin sums over DP: a device tensor, though the batch
             # (and so kappa) lives in host memory
             "comppo:position": ("comppo", ["algorithm.params.critic_layers=1",
                                            "algorithm.params.gate_control=position"])}
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/logp_diff_abs",
        "fipo/weight_mean", "fipo/weight_max", "critic/value_loss", "critic/grad_norm")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_update_on_the_device_equals_the_cpu_path(name):
    algorithm, overrides = SCENARIOS[name]
    cpu = _fixed_batch(algorithm, overrides + LOCAL, fake=False)
    dev = _fixed_batch(algorithm, overrides + LOCAL, fake=True)
    assert len(dev) == len(cpu) == 2 and all(m["changed"] for m in dev)
    assert cpu[1]["actor/grad_norm"] > 0
    for i, (a, b) in enumerate(zip(cpu, dev)):
        for k in KEYS:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), f"{name} step {i} {k}: {b[k]} vs {a[k]}"


def _launch(out: str, *args: str, fake: bool, nproc: int = 1, timeout: int = 600):
    entry = ["-m", "tests.support.fakegpu_run"] if fake else [os.path.join(ROOT, "pretrain_rl.py")]
    cmd = [sys.executable, *entry, "--output-dir", out, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), *cmd[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _same_numbers(cpu: list[dict], dev: list[dict]) -> None:
    """Every metric equal up to float noise: the CPU path runs the CPU attention of ``models/cpu_attention.py``,
    the device path megatron's own (1e-6-level differences; explained variance, a ratio of small
    differences after an update, moves ~1e-4; the engine mismatch is ~2e-7 on both)."""
    assert [r["step"] for r in dev] == [r["step"] for r in cpu]
    for a, b in zip(cpu, dev):
        assert b["reward/mean"] == a["reward/mean"]  # the same samples
        for k, v in a.items():
            if not k.startswith(VOLATILE) and isinstance(v, float):
                rel = 1e-3 if k == "critic/explained_var" else 1e-5
                assert b[k] == pytest.approx(v, rel=rel, abs=1e-6), f"step {a['step']} {k}: {b[k]} vs {v}"


RUN = ["warmup.steps=4", "warmup.batch_size=16", "train.val_every=0", "rollout.prompts_per_step=8",
       "logging.progress=false", "logging.plots=false", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
       "optim.backend=megatron", "checkpoint.every=1", *LOCAL]


def test_the_trainer_on_the_device_warms_up_syncs_checkpoints_and_resumes(tmp_path):
    # warm-up (cached under the run's parent), reference model, megatron optimizer, HF engine weight sync,
    # a torch_dist checkpoint of device tensors every iteration, then a resume that loads them back
    runs = {}
    for fake in (False, True):
        out, cache = str(tmp_path / ("dev" if fake else "cpu")), str(tmp_path / f"cache-{fake}")
        _launch(out, *RUN, f"warmup.cache_dir={cache}", "train.steps=1", fake=fake)
        proc = _launch(out, *RUN, f"warmup.cache_dir={cache}", "train.steps=2", fake=fake)
        assert "resumed from" in proc.stdout, proc.stdout[-2000:]
        runs[fake] = metrics_rows(out)
    dev = runs[True]
    assert [r["step"] for r in dev] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in dev)
    assert all(r["mismatch/logprob_abs_mean"] < 1e-4 for r in dev)  # the engine got the device weights
    assert all(r["actor/kl_ref"] > 0 for r in dev[1:])  # the reference pass ran (0 on the first step: ref == policy)
    assert all("actor/kl_ref" in r for r in dev)
    _same_numbers(runs[False], dev)


def test_torchrun_tensor_parallel_on_the_device(tmp_path):
    args = ["parallel.tensor_model_parallel_size=2", "train.steps=1", "warmup.steps=0", "train.val_every=0",
            "rollout.prompts_per_step=8", "logging.progress=false", "logging.plots=false",
            "algorithm.name=ppo", "checkpoint.every=0", "checkpoint.save_at_end=false", *LOCAL]
    _launch(str(tmp_path / "cpu"), *args, fake=False, nproc=2)
    _launch(str(tmp_path / "dev"), *args, fake=True, nproc=2)
    dev = metrics_rows(str(tmp_path / "dev"))
    assert dev[0]["actor/grad_norm"] > 0 and dev[0]["mismatch/logprob_abs_mean"] < 1e-4
    _same_numbers(metrics_rows(str(tmp_path / "cpu")), dev)
