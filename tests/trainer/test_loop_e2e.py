"""The RL trainer end to end on CPU: every algorithm trains, a resumed run equals an uninterrupted one,
an interrupted save is never taken for a checkpoint, and the command line behaves.

Runs through ``megatron_credit.trainer.loop.train`` (the megatron actor, the ``hf`` engine, the reward
functions) in a one-rank gloo worker; the command-line tests start ``pretrain_rl.py`` itself.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.support.distributed_harness import module_pool
from tests.support.paths import ROOT
from tests.support.runs import CLI_TINY, char_tokenizer, metrics_rows, run_pretrain_rl, stable, train_tiny


pytestmark = pytest.mark.dist


pool = module_pool(1)


REQUIRED = ("step", "reward/mean", "accuracy/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
            "actor/ppo_kl", "actor/clipfrac_high", "actor/grad_norm", "actor/lr", "time/step_s",
            "throughput/tokens_per_s", "mismatch/logprob_abs_mean")


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "rloo", "gspo", "ppo", "fipo"])
def test_every_algorithm_trains_two_iterations(pool, tmp_path, algorithm):
    rows = pool.run(train_tiny, str(tmp_path), "none", [f"algorithm.name={algorithm}"])[0]
    assert [r["step"] for r in rows] == [1, 2] and metrics_rows(tmp_path) == [
        {k: v for k, v in r.items()} for r in rows]
    for r in rows:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert r["mismatch/logprob_abs_mean"] < 1e-4  # engine and actor hold the same weights
    assert "val/accuracy" in rows[1] and "val/accuracy" not in rows[0]
    if algorithm == "fipo":
        assert rows[0]["fipo/weight_min"] >= 1.0 and rows[0]["fipo/weight_max"] <= 1.2 + 1e-6
        assert all(r["fipo/first_minibatch_max_abs_dev"] == 0.0 for r in rows)  # on-policy: weights are 1
    if algorithm == "ppo":
        assert "critic/value_loss" in rows[0] and "critic/explained_var" in rows[0]


def test_megatron_distributed_optimizer_trains_after_the_warm_up(pool, tmp_path):
    # The supervised warm-up steps a second megatron optimizer of the same kind (a cache of its own under
    # tmp_path, so the warm-up runs here); the run's optimizer then reloads its fp32 copies from the
    # warmed-up model and trains. The local run after it loads that cache: the same starting policy.
    cache = tmp_path / "warmup-cache"  # train_tiny's cache: next to the run directory
    assert not cache.exists()
    rows = pool.run(train_tiny, str(tmp_path / "megatron"), "none", ["algorithm.name=ppo", "optim.backend=megatron",
                                                                 "optim.distributed_optimizer=true"])[0]
    assert any(cache.rglob("*.pt"))  # the warm-up ran here (with the megatron optimizer) and filled it
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert r["mismatch/logprob_abs_mean"] < 1e-4  # engine and actor hold the same weights
    local = pool.run(train_tiny, str(tmp_path / "local"), "none", ["algorithm.name=ppo"])[0]
    assert rows[0]["reward/mean"] == local[0]["reward/mean"]  # the same warmed-up policy samples the same
    assert rows[0]["actor/pg_loss"] == pytest.approx(local[0]["actor/pg_loss"], rel=1e-5, abs=1e-7)


def _torchrun(*args, nproc: int = 2, timeout: int = 300):
    """``pretrain_rl.py`` under ``torch.distributed.run`` with ``nproc`` local ranks (gloo)."""
    from tests.support.distributed_harness import _free_port

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(_free_port()), os.path.join(ROOT, "pretrain_rl.py"), *args],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("backend", [[], ["optim.backend=megatron"], ["optim.backend=megatron",
                                                                      "optim.distributed_optimizer=true"]],
                         ids=["local", "megatron", "megatron+distopt"])
def test_resume_continues_bit_identically_and_reshards(tmp_path, backend):
    # megatron+distopt: megatron's optimizer state (fully_sharded_model_space) saved, resumed, resharded.
    CLI_TINY = [*globals()["CLI_TINY"], *backend]
    a, b, c = (str(tmp_path / x) for x in "abc")
    for out, steps in ((a, 4), (b, 4)):
        assert run_pretrain_rl("--output-dir", out, *CLI_TINY, f"train.steps={steps}").returncode == 0
    # A crash after iteration 4 was logged but before its checkpoint was complete: the newest complete
    # checkpoint is iteration 2, and lines 3-4 of metrics.jsonl are dropped and re-done.
    shutil.copytree(os.path.join(b, "checkpoints", "iter_0000002"), os.path.join(c, "checkpoints", "iter_0000002"))
    shutil.rmtree(os.path.join(b, "checkpoints", "iter_0000004"))
    os.makedirs(os.path.join(b, "checkpoints", "iter_0000004.tmp", "model_optim"))
    with open(os.path.join(b, "checkpoints", "iter_0000004.tmp", "rank_00000.pt"), "wb") as f:
        f.write(b"half a checkpoint")
    proc = run_pretrain_rl("--output-dir", b, *CLI_TINY, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout and "iter_0000002" in proc.stdout, proc.stderr
    assert stable(metrics_rows(b)) == stable(metrics_rows(a)) and [r["step"] for r in metrics_rows(b)] == [1, 2, 3, 4]
    # actor/lr: each iteration's last step (1, 3, 5, 7) of the schedule lr 2e-4 (the demo's), warm-up 2, cosine
    # over 3 steps (step 3 is 2/3 into it: cos(2 pi / 3) = -1/2, a quarter of the way from the floor), floor 1e-4
    assert [r["actor/lr"] for r in metrics_rows(b)] == pytest.approx([2e-4, 1.25e-4, 1e-4, 1e-4], rel=1e-9)
    # Resuming with another schedule is refused (one line naming the field) unless the user says so.
    proc = run_pretrain_rl("--output-dir", b, *CLI_TINY, "train.steps=5", "optim.min_lr=2e-4")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "optim.min_lr: checkpoint 0.0001, recipe 0.0002" in errors[0] and "optim.resume_schedule=recipe" in errors[0]
    assert [r["step"] for r in metrics_rows(b)] == [1, 2, 3, 4]  # nothing written by the refused run
    with open(os.path.join(b, "config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["optim"]["min_lr"] == 1e-4  # the accepted launch's recipe, not the refused one's
    # The same checkpoint resumed at TP = 2: model and optimizer reshard; same prompts and seeds at DP = 1.
    shutil.copy(os.path.join(a, "metrics.jsonl"), os.path.join(c, "metrics.jsonl"))
    proc = _torchrun("--output-dir", c, *CLI_TINY, "train.steps=3", "parallel.tensor_model_parallel_size=2")
    assert proc.returncode == 0 and "resharded" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    third_tp2, third = metrics_rows(c)[2], metrics_rows(a)[2]
    assert third_tp2["step"] == 3 and third_tp2["reward/mean"] == third["reward/mean"]
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "actor/entropy"):
        assert third_tp2[k] == pytest.approx(third[k], rel=1e-4, abs=1e-6), k


def test_a_separate_critic_resumes_bit_identically_reshards_and_must_match(tmp_path):
    # PPO's value model of its own (algorithm.params.critic: separate): saved next to the policy
    # (critic_optim/), resumed exactly, resharded to TP = 2; a trunk recipe cannot resume its checkpoint.
    args = [*CLI_TINY, "algorithm.params.critic=separate", "optim.critic_lr=5e-4"]
    a, b, c = (str(tmp_path / x) for x in "abc")
    assert run_pretrain_rl("--output-dir", a, *args, "train.steps=4").returncode == 0
    assert run_pretrain_rl("--output-dir", b, *args, "train.steps=2").returncode == 0
    assert os.path.isdir(os.path.join(b, "checkpoints", "iter_0000002", "critic_optim"))
    proc = run_pretrain_rl("--output-dir", b, *args, "train.steps=4")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    rows = metrics_rows(a)
    assert stable(metrics_rows(b)) == stable(rows)
    assert all(r["critic/grad_norm"] > 0 and r["critic/skipped_steps"] == 0 for r in rows)
    # the critic's schedule: critic_lr x the policy's (warm-up 2, cosine over 3 to min_lr x critic_lr / lr)
    assert [r["critic/lr"] / r["actor/lr"] for r in rows] == pytest.approx([2.5] * 4, rel=1e-9)
    proc = run_pretrain_rl("--output-dir", b, *CLI_TINY, "train.steps=5")  # the trunk head: refused, nothing written
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "algorithm.params.critic" in errors[0], proc.stderr[-2000:]
    assert [r["step"] for r in metrics_rows(b)] == [1, 2, 3, 4]
    shutil.copytree(os.path.join(a, "checkpoints", "iter_0000002"), os.path.join(c, "checkpoints", "iter_0000002"))
    shutil.copy(os.path.join(a, "metrics.jsonl"), os.path.join(c, "metrics.jsonl"))
    proc = _torchrun("--output-dir", c, *args, "train.steps=3", "parallel.tensor_model_parallel_size=2")
    assert proc.returncode == 0 and "resharded" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    third_tp2 = metrics_rows(c)[2]
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "critic/grad_norm", "critic/explained_var"):
        assert third_tp2[k] == pytest.approx(rows[2][k], rel=1e-4, abs=1e-6), k


def test_dry_run_prints_the_layout_and_builds_nothing(tmp_path):
    proc = run_pretrain_rl("--dry-run", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "layout TP=1 PP=1 CP=1 DP=1" in proc.stdout and "algorithm fipo" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_user_errors_are_one_line_and_exit_2(tmp_path):
    for args, message in ((["parallel.tensor_model_parallel_size=3"],
                           "tensor_model_parallel_size=3 does not divide num_attention_heads"),
                          (["algorithm.name=trpo"], "unknown algorithm 'trpo'; valid names"),
                          (["rollout.prompts_per_step=63", "rollout.n=3", "--dry-run"], "train.num_minibatches=2 must divide")):
        proc = run_pretrain_rl(*args)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and message in lines[0], proc.stderr


@pytest.mark.slow
def test_the_demo_learns_and_changes_the_parameters(tmp_path):
    """A short ``make demo``: after the warm-up, sampled accuracy rises well past where RL started and past
    the majority-answer rate, and the trained weights differ from the warmed-up ones."""
    import torch

    from megatron_credit.data.synthetic import ArithConfig, majority_answer_rate

    run = tmp_path / "demo"
    proc = run_pretrain_rl("--output-dir", str(run), "train.steps=40", "train.val_every=0",
                f"warmup.cache_dir={tmp_path / 'cache'}", "checkpoint.every=0", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = metrics_rows(run)
    acc = [r["accuracy/mean"] for r in rows]
    first, last = sum(acc[:5]) / 5, sum(acc[-5:]) / 5
    assert last > first + 0.05 and last > majority_answer_rate(ArithConfig(min_operand=10, max_operand=99))
    assert last > 0.7  # the demo's promise, reached by iteration 40 on every seed measured (README)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    warm = torch.load(next((tmp_path / "cache").rglob("rank_00000.pt")), weights_only=True)
    dcp_to_torch_save(str(run / "checkpoints" / "iter_0000040" / "model_optim"), str(tmp_path / "trained.pt"))
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)  # written by this test just above
    layers = sorted({k.split(".", 3)[3] for k in warm if k.startswith("decoder.layers.") and "extra" not in k}
                    & {k.split(".", 2)[2] for k in trained if k.startswith("decoder.layers.")})
    assert len(layers) >= 5  # qkv weight and bias, proj, fc1, fc2 (norms are saved under TE names)
    pairs = [(k, warm[k], trained[k]) for k in ("embedding.word_embeddings.weight", "output_layer.weight",
                                                 "decoder.final_layernorm.weight")]
    pairs += [(k, torch.stack([warm[f"decoder.layers.{i}.{k}"] for i in range(2)]), trained[f"decoder.layers.{k}"])
              for k in layers]
    assert all(w.shape == t.shape for _, w, t in pairs)
    unchanged = [k for k, w, t in pairs if torch.equal(w, t)]
    assert not unchanged, unchanged
    assert os.path.exists(run / "plots" / "reward.png") and os.path.exists(run / "config.yaml")


# PPO at TP 2 under torchrun, the engine's log-probs the actor's at every iteration: the rehearsal of
# examples/ppo_qwen25_7b.yaml (tests/tools/test_rehearse.py).
def test_torchrun_data_parallel_with_overlapped_reduction_and_gather(tmp_path):
    # DP = 2, megatron's distributed optimizer with overlap_grad_reduce and overlap_param_gather: the
    # engines of iteration 2 sample with weights the actor gathered before the sync (the shard each rank
    # does not own included), so the engine's and the actor's log-probs agree; a checkpoint is written.
    args = ["--output-dir", str(tmp_path / "dp2"), "train.steps=2", "warmup.steps=0", "train.val_every=0",
            "rollout.prompts_per_step=8", "logging.progress=false", "logging.plots=false", "algorithm.name=ppo",
            "optim.backend=megatron", "optim.distributed_optimizer=true", "optim.overlap_grad_reduce=true",
            "optim.overlap_param_gather=true", "train.max_tokens_per_microbatch=64", "checkpoint.every=2"]
    proc = _torchrun(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics_rows(tmp_path / "dp2")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0 for r in rows)
    assert all(r["mismatch/logprob_abs_mean"] < 1e-4 for r in rows), [r["mismatch/logprob_abs_mean"] for r in rows]
    assert (tmp_path / "dp2" / "checkpoints" / "iter_0000002" / "meta.json").exists()


def test_a_dapo_schema_jsonl_dataset_trains(pool, tmp_path):
    """``data.source: dataset``: a DAPO-schema jsonl, a Hugging Face tokenizer, the DAPO verifier."""
    char_tokenizer(str(tmp_path / "tok"))
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
             "reward_model": {"ground_truth": str(a + b)}} for a in range(6) for b in range(4)]
    with open(tmp_path / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = pool.run(train_tiny, str(tmp_path / "run"), "none",
                   ["data.source=dataset", f"data.train_path={tmp_path / 'train.jsonl'}",
                    f"data.tokenizer_path={tmp_path / 'tok'}", "data.max_prompt_len=32", "warmup.steps=0",
                    "train.val_every=0",
                    "model.architecture.vocab_size=96", "algorithm.name=ppo", "train.steps=2"])[0]
    assert [r["step"] for r in out] == [1, 2] and out[0]["actor/grad_norm"] > 0
    assert out[0]["mismatch/logprob_abs_mean"] < 1e-4


def test_kl_penalty_to_a_frozen_reference(pool, tmp_path):
    """``algorithm.kl_coef > 0``: the reference pass runs with the update's plan; k3 KL is >= 0, and 0 on
    the first mini-batch of the first iteration (policy == reference), so the mean over the run is small."""
    rows = pool.run(train_tiny, str(tmp_path), "none", ["algorithm.name=grpo", "algorithm.kl_coef=0.05"])[0]
    assert all(r["actor/kl_ref"] >= 0.0 for r in rows) and rows[1]["actor/kl_ref"] > 0.0
    assert rows[0]["actor/kl_ref"] < rows[1]["actor/kl_ref"]
