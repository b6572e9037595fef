"""Rollouts that overlap training (``rollout.mode: one_step_off | async``, ``sources/overlap.py``).

- the correction: the decoupled objective against a float64 loop reference, FIPO's weights against the
  proximal policy (exactly 1 on the first mini-batch whatever the staleness), CompPO's gates from the
  trainer's own weights whatever the behaviour policy;
- through the command line (a rollout pool of ``rollout.ranks`` next to the trainer, started by
  ``pretrain_rl.py`` itself or by torchrun): ``max_staleness: 0`` is ``sync`` bit for bit (a pool of 1 and of
  2 engines), staleness per mode never above the bound, resume, a killed pool rank or trainer, waits that
  end on silence and not on time;
- the demo recipe learns in ``one_step_off`` and in ``async`` with 2 trainer ranks and a pool rank (a world
  of 3 processes).
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_credit.credit.future_kl import fipo_weights
from megatron_credit.losses.policy import fipo_policy_loss
from megatron_credit.losses.importance import truncated_is_weights
from tests.references import fipo_weights_reference
from tests.support.distributed_harness import module_pool
from tests.support.fixed_batch import _run_fixed
from tests.support.paths import ROOT
from tests.support.leftovers import left, marked_env, wait_until_none_left
from tests.support.runs import TINY, metrics_rows, run_pretrain_rl, stable, subprocess_env, tiny_recipe_file


# ------------------------------------------------------------------------------------ the correction
def _decoupled_reference(logp, prox, behav, adv, mask, *, el, eh, c, tau, clip, cap):
    """The decoupled FIPO objective one token at a time: the dual-clip PPO loss of ``f * A`` with the
    ratio against the proximal policy, ``f`` the Future-KL weight of (current, proximal), times the
    behaviour correction min(pi_prox / pi_behav, cap)."""
    f = fipo_weights_reference(logp, prox, adv, mask, tau=tau, clip=clip, c=c)
    out = torch.zeros_like(logp)
    for i, t in mask.nonzero().tolist():
        a = float(adv[i, t] * f[i, t])
        r = math.exp(float(logp[i, t] - prox[i, t]))
        val = max(-a * r, -a * min(max(r, 1 - el), 1 + eh))
        if a < 0:
            val = min(val, -a * c)
        out[i, t] = val * min(math.exp(float(prox[i, t] - behav[i, t])), cap)
    return out


def test_decoupled_fipo_objective_matches_loop():
    g = torch.Generator().manual_seed(3)
    b, t = 5, 40
    prox = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = prox + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behav = prox + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)  # a stale engine's
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    lens = torch.randint(5, t, (b,), generator=g)
    mask = torch.arange(t)[None] < lens[:, None]
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, tau=8.0, weight_clip=(1.0, 1.2))
    isw, m = truncated_is_weights(prox, behav, mask, cap=2.0)
    loss, _ = fipo_policy_loss(logp, prox, adv, mask, is_weights=isw, **kw)
    ref = _decoupled_reference(logp, prox, behav, adv, mask, el=0.2, eh=0.28, c=3.0, tau=8.0, clip=(1.0, 1.2), cap=2.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert 0 < float(m["tis_capped_frac"]) < 1  # the cap was exercised
    # The Future-KL compares the current and the proximal policy: the behaviour policy does not enter the
    # weights, and with current == proximal (the first mini-batch) they are exactly 1 however stale it is.
    w_first, _ = fipo_weights(prox, prox, adv, mask, tau=8.0, clip=(1.0, 1.2), dual_clip_c=3.0)
    assert torch.equal(w_first, torch.ones_like(w_first))


pool1 = module_pool(1)


def _stale_engine(batch, plan):
    """The engine's log-probs of a stale policy: the trainer's (proximal) plus a fixed perturbation per
    token. Returns the expected first-step loss of each mini-batch: on its first step the current policy
    is the proximal one (ratio 1, FIPO weights 1), so the token mean of -A min(pi_prox / pi_behav, 2)."""
    g = torch.Generator().manual_seed(11)
    batch.rollout_logp = batch.old_logp + torch.randn(batch.old_logp.shape, generator=g) * 0.8
    out = {}
    for k, mini in enumerate(plan):
        r = [i for mb in mini for i in mb]
        m = batch.loss_mask[r]
        w = torch.exp((batch.old_logp[r] - batch.rollout_logp[r]).double()).clamp(max=2.0)
        out[f"want/{k}/pg_loss"] = float(-(batch.advantages[r].double() * w * m).sum() / m.sum())
    return out


@pytest.mark.dist
def test_an_off_policy_run_trains_the_decoupled_objective_and_fipo_weights_the_proximal_policy(pool1):
    # rollout.mode=async with a bound above 0 and no algorithm.tis_cap: the update truncates pi_prox /
    # pi_behav at OFF_POLICY_TIS_CAP (2.0), and FIPO's first mini-batch still has weights exactly 1.
    out = pool1.run(_run_fixed, {}, "fipo", overrides=["rollout.mode=async", "rollout.max_staleness=2", "rollout.ranks=1"],
                    prepare=_stale_engine)[0]
    assert out[0]["actor/pg_loss"] == pytest.approx(out[0]["want/0/pg_loss"], rel=1e-5, abs=1e-7)
    assert out[0]["fipo/weight_min"] == out[0]["fipo/weight_max"] == 1.0  # the first step: weights exactly 1
    assert 0 < out[0]["mismatch/tis_capped_frac"] < 1
    assert out[1]["fipo/weight_max"] > 1.0  # the second mini-batch: the policy moved from the proximal one
    on = pool1.run(_run_fixed, {}, "fipo", prepare=_stale_engine)[0]  # sync: no correction unless asked
    assert "mismatch/tis_capped_frac" not in on[0]


def _gates(batch, plan):
    return {"kappa": float(batch.extras["kappa"].double().sum()), "gates": float(batch.extras["gates"].double().sum())}


def _behaviour_from_another_version(batch):
    g = torch.Generator().manual_seed(5)
    batch.rollout_logp = -torch.rand(batch.rollout_logp.shape, generator=g) * 4
    batch.policy_version = torch.full((batch.size,), -3)


@pytest.mark.dist
def test_comppo_gates_come_from_the_trainer_weights_whatever_the_behaviour_policy(pool1):
    # The gates are read from the behaviour pass, which runs the trainer's current weights: samples of an
    # older version, with other engine log-probs, get the gates and advantages on-policy samples get.
    on = pool1.run(_run_fixed, {}, "comppo")[0]
    off = pool1.run(_run_fixed, {}, "comppo", overrides=["rollout.mode=async", "rollout.max_staleness=3", "rollout.ranks=1"],
                    before=_behaviour_from_another_version, prepare=_gates)[0]
    on_g = pool1.run(_run_fixed, {}, "comppo", prepare=_gates)[0]
    assert off[0]["kappa"] == on_g[0]["kappa"] and off[0]["gates"] == on_g[0]["gates"]
    assert on[0]["critic/value_loss"] == off[0]["critic/value_loss"]


# ---------------------------------------------------------------------------- the command line
def _recipe(tmp_path, **sections) -> str:
    return tiny_recipe_file(tmp_path, "async-warmup-cache", **sections)


def _rows_of(run):
    return [r for r in metrics_rows(run)]


@pytest.mark.dist
def test_max_staleness_0_is_sync_bit_for_bit(tmp_path):
    recipe = _recipe(tmp_path, train={"steps": 3})
    a = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "sync")
    b = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "async0", "rollout.mode=async",
                        "rollout.max_staleness=0", "rollout.ranks=1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    sync, async0 = stable(_rows_of(tmp_path / "sync")), stable(_rows_of(tmp_path / "async0"))
    # at world 1 sync moves no samples between processes, the pool of one rank does (each group once)
    assert len(sync) == 3 and _without(sync, LAYOUT) == _without(async0, LAYOUT)
    assert all(r["transfer/sample_bytes"] > r["transfer/sample_payload_bytes"] > 0 for r in async0)
    assert "val/accuracy" in sync[1] and all(r["rollout/staleness_max"] == 0 for r in sync)
    assert all(r["transfer/weight_bytes"] == r["sync/bytes"] > 0 for r in _rows_of(tmp_path / "async0"))


POOL_ONLY = ("transfer/weight_bytes",)
"""What a pool run logs and ``sync`` does not (the weights the engines received)."""
LAYOUT = ("transfer/", "rollout/engines")
"""What depends on where the engines are, not on the samples (the bytes moved; a pool of 1 engine against
``sync``'s world of 2)."""


def _without(rows, drop=POOL_ONLY):
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def _torchrun(n: int, *args, timeout=600):
    from tests.support.distributed_harness import _free_port

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                           str(_free_port()), os.path.join(ROOT, "pretrain_rl.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=timeout)


@pytest.mark.dist
def test_a_pool_of_two_engines_is_sync_at_the_same_trainer_layout(tmp_path):
    # World 4 under torchrun: 2 trainer ranks (DP 2) + 2 pool ranks (2 HF engines, each its half of a draw's
    # prompts), against sync at world 2 (its 2 engines on the trainer's ranks): every non-time field equal,
    # the sample bytes too (each group once, to its replica's head).
    recipe = _recipe(tmp_path, train={"steps": 3})
    a = _torchrun(2, "--config", recipe, "--output-dir", tmp_path / "sync")
    b = _torchrun(4, "--config", recipe, "--output-dir", tmp_path / "pool", "rollout.mode=async",
                  "rollout.max_staleness=0", "rollout.ranks=2")
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    sync, pool = stable(_rows_of(tmp_path / "sync")), stable(_rows_of(tmp_path / "pool"))
    assert len(sync) == 3 and sync == _without(pool)
    # both engines received every version whole
    assert all(r["transfer/weight_bytes"] == 2 * r["sync/bytes"] > 0 for r in _rows_of(tmp_path / "pool"))


@pytest.mark.dist
@pytest.mark.parametrize("mode,bound", [(["rollout.mode=one_step_off"], 1),
                                        (["rollout.mode=async", "rollout.max_staleness=2"], 2)])
def test_a_pool_of_two_ranks_stays_within_the_bound(tmp_path, mode, bound):
    recipe = _recipe(tmp_path, train={"steps": 5})
    out = _torchrun(4, "--config", recipe, "--output-dir", tmp_path / "run", "rollout.ranks=2", *mode)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["rollout/staleness_max"] <= bound and sum(r[f"rollout/staleness_hist/{s}"] for s in range(bound + 1))
               == 32 for r in rows)
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["mismatch/logprob_abs_mean"] < 1e-4
    assert max(r["rollout/staleness_max"] for r in rows) >= 1  # the pool ran ahead
    assert "val/accuracy" in rows[1] and all(r["rollout/engines"] == 2 for r in rows)


@pytest.mark.dist
@pytest.mark.parametrize("mode,bound,extra", [("one_step_off", 1, []),
                                              ("async", 2, ["rollout.max_staleness=2"]),
                                              ("async", 1, ["rollout.on_update=partial"])])
def test_staleness_never_exceeds_the_bound(tmp_path, mode, bound, extra):
    recipe = _recipe(tmp_path, train={"steps": 5})
    out = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "run", f"rollout.mode={mode}",
                          "rollout.ranks=1", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        hist = [r[f"rollout/staleness_hist/{s}"] for s in range(bound + 1)]
        assert sum(hist) == 32 and r["rollout/staleness_max"] <= bound  # 8 prompts x 4 samples, all counted
        assert r["rollout/staleness_mean"] == pytest.approx(sum(s * h for s, h in enumerate(hist)) / 32)
    assert rows[0]["rollout/staleness_max"] == 0  # the first batch has only the initial weights
    assert rows[0]["mismatch/logprob_abs_mean"] < 1e-4  # ... and the engine got exactly those
    if mode == "one_step_off":  # then always one version old
        assert all(r["rollout/staleness_mean"] == 1 for r in rows[1:])


@pytest.mark.dist
def test_a_resumed_async_run_neither_loses_nor_repeats_prompts(tmp_path):
    from megatron_credit.trainer import checkpoint as ckpt

    recipe = _recipe(tmp_path, train={"steps": 4, "val_every": 0},
                     checkpoint={"every": 2, "keep": 3, "save_at_end": True})
    common = ["rollout.mode=one_step_off", "rollout.ranks=1", "logging.progress=false"]
    whole = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "whole", *common)
    first = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "split", *common, "train.steps=2")
    again = run_pretrain_rl("--config", recipe, "--output-dir", tmp_path / "split", *common, "--resume", "auto")
    for out in (whole, first, again):
        assert out.returncode == 0, out.stderr[-3000:]
    cursor = lambda run, step: ckpt.rank0_extras(os.path.join(run, "checkpoints", f"iter_{step:07d}"))["prompts"]["cursor"]  # noqa: E731
    # every iteration's draws took 8 prompts each, from where the previous one stopped
    for run in (tmp_path / "whole", tmp_path / "split"):
        rows = _rows_of(run)
        assert cursor(run, 4) == 8 * sum(r["rollout/draws"] for r in rows if r["step"] <= 4)
    assert cursor(tmp_path / "split", 2) == cursor(tmp_path / "whole", 2)
    assert cursor(tmp_path / "split", 4) == cursor(tmp_path / "whole", 4)
    rows = _rows_of(tmp_path / "split")
    # the batch in flight at the checkpoint was dropped and generated again with the checkpoint's weights
    assert [r["rollout/staleness_mean"] for r in rows if r["step"] > 2] == [0.0, 1.0]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _start(tmp_path, *args, env=None):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env or subprocess_env())


def _rollout_process(trainer: subprocess.Popen, run_dir, timeout_s: float = 120) -> int:
    """The pid of the pool rank ``pretrain_rl.py`` started, once the trainer logged its first iteration."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path) and os.path.getsize(path) > 0:
            for pid in _children(trainer.pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"pretrain_rl.py" in f.read():
                        return pid
        assert trainer.poll() is None, trainer.communicate()[1][-2000:]
        time.sleep(0.5)
    raise AssertionError("no rollout process")


@pytest.mark.dist
def test_a_killed_rollout_process_stops_the_run_with_one_line(tmp_path):
    recipe = _recipe(tmp_path, train={"steps": 500, "val_every": 0})
    trainer = _start(tmp_path, "--config", recipe, "--output-dir", tmp_path / "run", "rollout.mode=async",
                     "rollout.ranks=1")
    os.kill(_rollout_process(trainer, tmp_path / "run"), signal.SIGKILL)
    t0 = time.time()
    _, err = trainer.communicate(timeout=90)
    assert trainer.returncode == 2 and time.time() - t0 < 60
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rollout pool rank 1" in lines[0], err[-2000:]


@pytest.mark.dist
def test_a_killed_trainer_leaves_no_process_behind(tmp_path):
    # SIGKILL: the trainer runs no shutdown. The rollout process and the reward worker it started end anyway
    # (the rollout process polls its parent; the trainer's guard, megatron_credit/lifetime.py, ends the rest).
    recipe = _recipe(tmp_path, train={"steps": 500, "val_every": 0})
    env, mark = marked_env(subprocess_env())
    trainer = _start(tmp_path, "--config", recipe, "--output-dir", tmp_path / "run", "rollout.mode=async",
                     "rollout.ranks=1", "reward.num_workers=1", env=env)
    rollout = _rollout_process(trainer, tmp_path / "run")
    assert any("verifier_worker" in line for line in left(mark)), left(mark)  # the rollout process's verifier worker
    trainer.kill()
    trainer.communicate(timeout=30)
    assert wait_until_none_left(mark) == []
    assert not os.path.exists(f"/proc/{rollout}") or _state(rollout) == "Z"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("mode", [["rollout.mode=async", "rollout.max_staleness=2"]])
def test_the_demo_learns_with_two_trainer_ranks_and_a_rollout_process(tmp_path, mode):
    # 2 trainer ranks (DP 2) and a pool rank under torchrun: a world of 3 processes. Measured with the
    # rollout process this replaced, over the full 160 iterations: validation 0.887 / 0.957 / 0.977 at 20 /
    # 40 / 60 (one_step_off) and 0.812 / 0.945 / 0.961 (async, max_staleness 2). Only async runs here (the
    # staler of the two; one_step_off learns in tests/trainer/test_tool_calc_demo.py): CI's time.
    from tests.support.distributed_harness import _free_port

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                          str(_free_port()), os.path.join(ROOT, "pretrain_rl.py"), "--config", "examples/demo_cpu.yaml",
                          "--output-dir", str(tmp_path / "run"), "logging.progress=false", "logging.plots=false",
                          "checkpoint.every=0", "checkpoint.save_at_end=false", "train.steps=80", "rollout.ranks=1",
                          *mode],
                         capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows_of(tmp_path / "run")
    assert len(rows) == 80  # half the demo's 160 iterations
    bound = 1 if "one_step_off" in mode[0] else 2
    assert max(r["rollout/staleness_max"] for r in rows) <= bound
    assert max(r["rollout/staleness_max"] for r in rows) == bound  # the overlap happened
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert len(val) == 4 and max(val) >= 0.9, val


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["parallel.pipeline_model_parallel_size=2"],
                                    ["parallel.pipeline_model_parallel_size=2", "model.lora.rank=4"]],
                         ids=["pp2", "pp2-lora"])
def test_every_trainer_layout_feeds_the_rollout_process(tmp_path, layout):
    # (TP 2 feeding a vLLM pool: the rehearsal of examples/fipo_qwen25_32b_async.yaml, tests/tools/test_rehearse.py)
    # Two trainer ranks at PP 2 gather the weights for rank 0 to send to the pool rank: at max_staleness
    # 0 the pool samples with the version the trainer holds, so its log-probs equal the actor's every iteration
    # (PPO: its critic's advantages are not zero on the tiny task, so every update moves the weights). With
    # LoRA the version is the merged W + B A alpha / r of each stage, as many bytes as the full model.
    from tests.support.distributed_harness import _free_port

    recipe = _recipe(tmp_path, train={"steps": 3})
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                          str(_free_port()), os.path.join(ROOT, "pretrain_rl.py"), "--config", recipe, "--output-dir",
                          str(tmp_path / "run"), "rollout.mode=async", "rollout.max_staleness=0", "rollout.ranks=1",
                          "algorithm.name=ppo", *layout],
                         capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_mean"] < 1e-4 for r in rows), [r["mismatch/logprob_abs_mean"] for r in rows]
    # DP 1: the pool's one engine sends each group once to the replica's head, which hands the same message
    # to the replica's other rank
    assert all(r["transfer/sample_broadcast_bytes"] == r["transfer/sample_bytes"] > r["transfer/sample_payload_bytes"]
               > 0 for r in rows)


@pytest.mark.parametrize("overrides,line", [
    (["rollout.mode=fast"], "unknown rollout.mode 'fast'; valid names: ['async', 'one_step_off', 'sync']"),
    (["rollout.mode=async", "rollout.ranks=1", "rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0, got -1"),
    (["rollout.mode=one_step_off", "rollout.ranks=1", "rollout.max_staleness=2"], "rollout.max_staleness=2: one_step_off trains on"),
    (["rollout.on_update=restart"], "rollout.on_update must be 'finish' or 'partial', got 'restart'"),
    (["rollout.mode=async", "rollout.ranks=-1"], "rollout.ranks must be >= 0, got -1"),
    (["rollout.mode=async"], "rollout.mode=async generates on a rollout pool: set rollout.ranks >= 1"),
    (["rollout.ranks=2"], "rollout.ranks=2: sync generates on the trainer's own ranks"),
    (["rollout.wait_timeout_s=0"], "rollout.wait_timeout_s must be > 0, got 0"),
])
def test_bad_rollout_mode_fields_get_one_line_naming_them(overrides, line):
    from megatron_credit.recipe.config import recipe_from_dict

    with pytest.raises(ValueError) as err:
        recipe_from_dict(TINY, overrides=overrides)
    assert line in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,line", [
    (["rollout.mode=async", "rollout.ranks=3", "rollout.engine_options.tensor_parallel_size=2"],
     "rollout.ranks=3 must be a multiple of rollout.engine_options.tensor_parallel_size=2"),
    (["rollout.mode=async", "rollout.ranks=1", "rollout.on_update=partial", "rollout.engine=vllm"],
     "rollout.on_update=partial: the vllm engine cannot take new weights in the middle of a draw"),
])
def test_rollout_process_recipes_that_cannot_run_are_refused(overrides, line):
    from megatron_credit.recipe.config import recipe_from_dict

    recipe = recipe_from_dict(TINY, overrides=overrides)
    assert any(line in p for p in recipe.problems(recipe.model.hf_config(), world_size=1))
    assert recipe_from_dict(TINY, overrides=["rollout.mode=async", "rollout.ranks=2"]).problems(
        recipe.model.hf_config(), world_size=1) == []
