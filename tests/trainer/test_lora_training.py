"""LoRA in the trainer (``model.lora``): every algorithm trains its adapters and leaves the base as it is, the
update is the same in every layout, the engine samples the merged policy, the KL reference is the adapters
off, and a checkpoint holds the adapters only and resumes exactly, also under another layout.

- the fixed batch of ``tests/support/fixed_batch.py`` (two optimizer steps of the trainer's own update):
  the adapters move, the base does not (bit for bit), at world size 1 and at TP = 2 (+SP), PP = 2, CP = 2
  with the same losses and gradient norms;
- ``pretrain_rl.py`` with ``model.lora.rank=4`` (PPO, a trunk critic, the KL to the reference): the ``hf``
  engine's log-probs are the trainer's (the merged weights reach it), the checkpoint holds the adapters and
  the value head (no base weight), a resume continues bit for bit and a TP = 2 resume reshards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.fixed_batch import _run_fixed
from tests.support.paths import ROOT
from tests.support.runs import CLI_TINY, metrics_rows, run_pretrain_rl, stable

pool1 = module_pool(1)
pool2 = module_pool(2)

LORA = ["model.lora.rank=4"]
KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "fipo/weight_max", "critic/value_loss")


@pytest.mark.dist
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo", "fipo", "ppo", "comppo"])
def test_every_algorithm_trains_the_adapters_and_never_the_base(pool1, algorithm):
    extra = ["algorithm.params.critic_layers=1"] if algorithm == "comppo" else []
    steps = pool1.run(_run_fixed, {}, algorithm, overrides=LORA + extra)[0]
    assert all(s["changed"] and not s["base_changed"] for s in steps), steps
    assert steps[1]["actor/grad_norm"] > 0 and steps[1]["actor/logp_diff_abs"] > 0
    if algorithm in ("ppo", "comppo"):  # the critic's head trains in full
        assert steps[1]["critic/value_loss"] > 0


@pytest.mark.dist
def test_the_lora_update_is_the_same_in_every_layout(pool1, pool2):
    ref = pool1.run(_run_fixed, {}, "fipo", overrides=LORA)[0]
    for name, layout in {"TP=2": {"tensor_model_parallel_size": 2},
                         "TP=2+SP": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                         "PP=2": {"pipeline_model_parallel_size": 2}, "CP=2": {"context_parallel_size": 2}}.items():
        got = pool2.run(_run_fixed, layout, "fipo", overrides=LORA)[0]
        assert not any(s["base_changed"] for s in got), name
        for i, (a, b) in enumerate(zip(ref, got)):
            for k in KEYS:
                if k in a:
                    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), f"{name} step {i} {k}: {b[k]} vs {a[k]}"


@pytest.mark.dist
def test_megatron_s_distributed_optimizer_holds_the_adapters_alone(pool1, pool2):
    """optim.backend megatron with its distributed optimizer at DP 2: its buffers are the DDP buffers, which
    hold only the adapters, so the base never moves and the update is DP 1's with our AdamW."""
    ref = pool1.run(_run_fixed, {}, "fipo", overrides=LORA)[0]
    got = pool2.run(_run_fixed, {}, "fipo", overrides=[*LORA, "optim.backend=megatron",
                                                         "optim.distributed_optimizer=true"])[0]
    assert all(s["changed"] and not s["base_changed"] for s in got), got
    for i, (a, b) in enumerate(zip(ref, got)):
        for k in ("actor/pg_loss", "actor/grad_norm", "fipo/weight_max"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), f"step {i} {k}: {b[k]} vs {a[k]}"


def _torchrun(*args):
    from tests.support.runs import subprocess_env

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           os.path.join(ROOT, "pretrain_rl.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(subprocess_env(), OMP_NUM_THREADS="1"), timeout=600)


def _checkpoint_keys(folder: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(folder).read_metadata().state_dict_metadata)


@pytest.mark.dist
def test_a_lora_run_syncs_merged_weights_saves_its_adapters_and_resumes_exactly(tmp_path):
    args = [*CLI_TINY, *LORA, "algorithm.kl_coef=0.01"]
    a, b, c = (str(tmp_path / x) for x in "abc")
    proc = run_pretrain_rl("--output-dir", a, *args, "train.steps=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the start says what trains (the planner's count: 2 layers x 4 linears' A and B at rank 4)
    assert ("trains: LoRA adapters (rank 4, alpha 8) on linear_qkv, linear_proj, linear_fc1, linear_fc2: 13,312 fp32 "
            "parameters, 4.3% of the base's 312,448, which stay frozen, and the critic in full; the KL reference is "
            "the adapters off\n") in proc.stdout, proc.stdout[:2000]
    rows = metrics_rows(a)
    # the engine (hf, in this process) samples with W + B A alpha / r: its log-probs are the trainer's
    assert all(r["mismatch/logprob_abs_mean"] < 1e-4 for r in rows) and rows[-1]["actor/grad_norm"] > 0
    assert all(r["actor/kl_ref"] > 0 for r in rows)  # the reference (the adapters off) is no longer the policy
    ckpt = os.path.join(a, "checkpoints", "iter_0000004")
    keys = _checkpoint_keys(os.path.join(ckpt, "model_optim"))
    weights = [k for k in keys if not k.startswith(("optimizer.", "common_state"))]  # (0.19.2 writes common_state)
    assert {k for k in weights if ".lora." not in k} == {"value_head.weight", "value_head.bias"}, weights
    assert len(weights) == 2 + 4 * 2  # 4 linears' A and B (layers stacked), the value head
    with open(os.path.join(ckpt, "meta.json")) as f:
        assert json.load(f)["lora"] == {"rank": 4, "alpha": 8.0, "base": None, "base_dtype": "float32",
                                        "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
    # resumed from iteration 2: the same numbers as the run that never stopped
    assert run_pretrain_rl("--output-dir", b, *args, "train.steps=2").returncode == 0
    proc = run_pretrain_rl("--output-dir", b, *args, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    assert stable(metrics_rows(b)) == stable(rows)
    # another rank is refused in one line, nothing written
    proc = run_pretrain_rl("--output-dir", b, *[x for x in args if x not in LORA], "model.lora.rank=8", "train.steps=5")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors == [f"error: --resume {os.path.join(b, 'checkpoints', 'iter_0000004')}: "
                                               "model.lora.rank: checkpoint 4, recipe 8"], proc.stderr[-2000:]
    # the checkpoint of iteration 2 at TP = 2: the adapters and their Adam moments reshard
    shutil.copytree(os.path.join(a, "checkpoints", "iter_0000002"), os.path.join(c, "checkpoints", "iter_0000002"))
    shutil.copy(os.path.join(a, "metrics.jsonl"), os.path.join(c, "metrics.jsonl"))
    proc = _torchrun("--output-dir", c, *args, "train.steps=3", "parallel.tensor_model_parallel_size=2")
    assert proc.returncode == 0 and "resharded" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    third = metrics_rows(c)[2]
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "actor/kl_ref"):
        assert third[k] == pytest.approx(rows[2][k], rel=1e-4, abs=1e-6), k


@pytest.mark.dist
def test_after_a_warm_up_that_trained_the_adapters_the_reference_is_the_merged_policy(tmp_path):
    """The warm-up moved the adapters: the reference is then a copy of the merged model (loaded one weight at
    a time), so iteration 1's KL to it starts near 0 (its first mini-batch is the reference's own policy)."""
    run = str(tmp_path / "w")
    proc = run_pretrain_rl("--output-dir", run, *CLI_TINY, *LORA, "algorithm.kl_coef=0.01", "warmup.steps=5",
                           "train.steps=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 0 < metrics_rows(run)[0]["actor/kl_ref"] < 1e-4
