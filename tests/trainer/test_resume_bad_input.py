"""Resume and run-directory faults: a checkpoint never runs code, a damaged one falls back, no
user file is replaced, a diverged run stops before it saves, and each failure is one line naming its cause.

Two tiny runs (GRPO and PPO, two iterations, a checkpoint after each) are made once by ``pretrain_rl.py``
in a subprocess (megatron's torch_dist writer needs a non-daemonic process); each test tampers with a
private copy. The checks that need no model run in the test process; resumes run ``pretrain_rl.py``
or, when no checkpoint is written, a one-rank gloo worker.
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.distributed_harness import module_pool
from tests.support.payloads import RunsCode
from tests.support.runs import TINY_CHECKPOINTED, metrics_rows, run_pretrain_rl

ITER1, ITER2 = "iter_0000001", "iter_0000002"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    (root / "recipe.yaml").write_text("# the user's recipe: these comments must survive\n"
                                      + yaml.safe_dump(TINY_CHECKPOINTED))
    for name, extra in (("grpo", []), ("ppo", ["algorithm.name=ppo"])):
        proc = run_pretrain_rl("--config", root / "recipe.yaml", "--output-dir", root / name, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(os.listdir(root / name / "checkpoints")) == [ITER1, ITER2]
    return root


@pytest.fixture
def run(made, tmp_path):
    """A private copy of the GRPO run."""
    shutil.copytree(made / "grpo", tmp_path / "run")
    return tmp_path / "run"


def _model_dir(run: Path, it: str = ITER2) -> Path:
    return run / "checkpoints" / it / "model_optim"


def _extra_state_item(model_dir: Path) -> tuple[Path, int, int]:
    from megatron_credit.conversion.safe_load import read_dist_metadata

    for index, info in read_dist_metadata(model_dir).storage_data.items():
        if "_extra_state" in index.fqn:
            return model_dir / info.relative_path, info.offset, info.length
    raise AssertionError("no _extra_state byte item")


def _evil_metadata(run: Path, marker: Path) -> Path:
    path = _model_dir(run) / ".metadata"
    path.write_bytes(pickle.dumps(RunsCode(marker)))
    return path


def _evil_byte_item(run: Path, marker: Path) -> Path:
    path, offset, length = _extra_state_item(_model_dir(run))
    payload = pickle.dumps(RunsCode(marker), protocol=2)
    assert len(payload) <= length
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload + bytes(length - len(payload)))
    return path


def _evil_rank_file(run: Path, marker: Path) -> Path:
    path = run / "checkpoints" / ITER2 / "rank_00000.pt"
    torch.save({"rng": RunsCode(marker)}, path)
    return path


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _unlink(path: Path) -> Path:
    path.unlink()
    return path


def _garbage(path: Path) -> Path:
    path.write_bytes(b"\x00garbage" * 7)
    return path


EVIL = {"metadata pickle": _evil_metadata, "extra_state byte item": _evil_byte_item, "rank file": _evil_rank_file}
DAMAGED = {
    "truncated distcp": (lambda r: _truncate(_model_dir(r) / "__0_0.distcp"), "truncated"),
    "deleted .metadata": (lambda r: _unlink(_model_dir(r) / ".metadata"), "is missing"),
    "deleted metadata.json": (lambda r: _unlink(_model_dir(r) / "metadata.json"), "is missing"),
    "garbage rank file": (lambda r: _garbage(r / "checkpoints" / ITER2 / "rank_00000.pt"), "cannot be read"),
    "garbage meta.json": (lambda r: _garbage(r / "checkpoints" / ITER2 / "meta.json"), "is not valid JSON"),
    "hand-made meta.json": (lambda r: (r / "checkpoints" / ITER2 / "meta.json").write_text('{"step": 2}') and
                            r / "checkpoints" / ITER2 / "meta.json", "does not name an integer 'step' and a 'layout'"),
    "deleted model_optim": (lambda r: shutil.rmtree(_model_dir(r)) or _model_dir(r), "is missing"),
}


@pytest.mark.parametrize("case", sorted(EVIL))
@pytest.mark.dist
def test_auto_skips_a_crafted_checkpoint_without_running_code(run, tmp_path, case):
    from megatron_credit.trainer.checkpoint import resolve

    marker = tmp_path / "pwned"
    bad = EVIL[case](run, marker)
    lines: list[str] = []
    assert resolve(str(run), "auto", log=lines.append) == str(run / "checkpoints" / ITER1)
    assert not marker.exists()
    assert len(lines) == 2 and str(bad) in lines[0] and "refusing" in lines[0], lines
    assert "falling back to" in lines[1] and ITER1 in lines[1], lines


@pytest.mark.parametrize("case", sorted(EVIL))
@pytest.mark.dist
def test_resume_path_refuses_a_crafted_file_naming_it(run, tmp_path, case):
    from megatron_credit.conversion.safe_load import UnsafeCheckpointError
    from megatron_credit.trainer.checkpoint import resolve

    marker = tmp_path / "pwned"
    bad = EVIL[case](run, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        resolve(str(run), str(run / "checkpoints" / ITER2), log=lambda *_: None)
    assert info.value.path == str(bad) and not marker.exists()


@pytest.mark.parametrize("case", sorted(DAMAGED))
@pytest.mark.dist
def test_a_damaged_newest_checkpoint_falls_back_and_is_named(run, case):
    from megatron_credit.conversion.hf_io import CheckpointFormatError
    from megatron_credit.trainer.checkpoint import resolve

    damage, why = DAMAGED[case]
    bad = damage(run)
    lines: list[str] = []
    assert resolve(str(run), "auto", log=lines.append) == str(run / "checkpoints" / ITER1)
    assert str(bad) in lines[0] and why in lines[0], lines
    with pytest.raises(CheckpointFormatError, match=why) as info:
        resolve(str(run), str(run / "checkpoints" / ITER2), log=lambda *_: None)
    assert info.value.path == str(bad)


@pytest.mark.dist
def test_auto_with_every_checkpoint_refused_is_one_error(run):
    from megatron_credit.trainer.checkpoint import resolve

    for it in (ITER1, ITER2):
        _truncate(_model_dir(run, it) / "__0_0.distcp")
    with pytest.raises(ValueError, match=r"--resume auto: every checkpoint of .* was refused"):
        resolve(str(run), "auto", log=lambda *_: None)


@pytest.mark.dist
def test_auto_resume_falls_back_runs_nothing_and_keeps_the_recipe_file(run, tmp_path):
    # The run directory's config.yaml is the --config (the user's own recipe, with comments).
    marker = tmp_path / "pwned"
    _evil_metadata(run, marker)
    recipe = run / "config.yaml"
    recipe.write_text("# my recipe, my comments\n" + recipe.read_text())
    before = recipe.read_bytes()
    proc = run_pretrain_rl("--config", recipe, "--output-dir", run, "train.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    assert "falling back to" in proc.stdout and f"resumed from {run / 'checkpoints' / ITER1}" in proc.stdout
    assert recipe.read_bytes() == before
    steps = [r["step"] for r in metrics_rows(run)]
    assert steps == [1, 2, 3]


@pytest.mark.dist
def test_resume_none_over_an_existing_run_refuses_and_changes_nothing(run):
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = run_pretrain_rl("--config", run / "config.yaml", "--output-dir", run, "--resume", "none")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--resume none" in errors[0] and "already holds a run" in errors[0], proc.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


# --- resumes with another model or algorithm: one line, before megatron reads data ------------------------
pool = module_pool(1)


def _train(run_dir: str, resume: str, overrides=(), patch=None):
    """``train`` in the worker; returns ``(rows or None, the error line or None, extra)``."""
    from megatron_credit import distributed
    from megatron_credit.cli import error_line
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import train

    recipe = recipe_from_dict(TINY_CHECKPOINTED, overrides=list(overrides))
    restore, extra = patch() if patch is not None else (lambda: None, None)
    device = distributed.initialize(recipe.parallel, seed=recipe.seed)
    try:
        return (train(recipe, recipe.model.hf_config(), run_dir=run_dir, device=device, resume=resume,
                      log=lambda *a: None), None, extra)
    except ValueError as exc:
        return None, error_line(exc), extra
    finally:
        distributed.destroy()
        restore()


MISMATCHES = {
    "another model size": ("grpo", ["model.architecture.hidden_size=64", "model.architecture.intermediate_size=96"],
                           "tensor(s) have another shape than this recipe's model"),
    "PPO resuming a GRPO checkpoint": ("grpo", ["algorithm.name=ppo"], "the checkpoint lacks"),
    "FIPO resuming a PPO checkpoint": ("ppo", ["algorithm.name=fipo"], "model tensor(s) this recipe's model does not have"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
@pytest.mark.dist
def test_resume_of_another_model_is_one_line(pool, made, tmp_path, case):
    source, overrides, message = MISMATCHES[case]
    shutil.copytree(made / source, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / ITER2
    rows, error, _ = pool.run(_train, str(tmp_path / "out"), str(ckpt), ["checkpoint.every=0", *overrides])[0]
    assert rows is None and error.startswith(f"error: --resume {ckpt / 'model_optim'}: ") and message in error, error
    assert "(model.architecture / model.name_or_path and algorithm.name" in error


pool2 = module_pool(2)

# At PP 2 each stage holds part of the model (the value head only the last); the check judges the whole
# model on every stage, so the verdict is the same on both, and a resume from one rank works (the layouts'
# test, tests/trainer/test_resume_layouts.py).
PP2_MISMATCHES = {
    "FIPO resuming a PPO checkpoint": ("ppo", ["algorithm.name=fipo"],
                                       "the checkpoint holds 2 model tensor(s) this recipe's model does not have, "
                                       "e.g. ['value_head.bias', 'value_head.weight']"),
    "PPO resuming a GRPO checkpoint": ("grpo", ["algorithm.name=ppo"],
                                       "the checkpoint lacks 6 tensor(s) this recipe's model needs, e.g. "
                                       "['value_head.bias', 'value_head.weight', "
                                       "'optimizer.state.exp_avg.value_head.bias']"),
}


@pytest.mark.parametrize("case", sorted(PP2_MISMATCHES))
@pytest.mark.dist
def test_resume_of_another_model_at_two_stages_is_one_line_on_every_stage(pool2, made, tmp_path, case):
    # A value head no stage of the new layout owns is refused by name on both stages, the first stage
    # included (it never owns the head); a head the checkpoint lacks too, never a hang in the load.
    source, overrides, message = PP2_MISMATCHES[case]
    shutil.copytree(made / source, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / ITER2
    ranks = pool2.run(_train, str(tmp_path / "out"), str(ckpt),
                      ["checkpoint.every=0", "parallel.pipeline_model_parallel_size=2", *overrides])
    errors = [error for _, error, _ in ranks]
    assert [rows for rows, _, _ in ranks] == [None, None] and errors[0] == errors[1], errors
    assert errors[0].startswith(f"error: --resume {ckpt / 'model_optim'}: {message} "), errors[0]
    assert "\n" not in errors[0]


@pytest.mark.dist
def test_verifier_counts_and_dropped_prompts_reach_metrics_jsonl(pool, tmp_path):
    rows, error, _ = pool.run(_train, str(tmp_path / "run"), "none",
                              ["reward.num_workers=1", "checkpoint.every=0", "checkpoint.save_at_end=false",
                               "train.steps=1"])[0]
    assert error is None, error
    line = metrics_rows(tmp_path / "run")[0]
    draws = line["rollout/draws"]
    assert line["verifier/items"] == 8 * 4 * draws and line["verifier/timeouts"] == 0
    assert line["verifier/errors"] == 0 and line["verifier/restarts"] == 0 and line["verifier/seconds"] > 0
    assert line["data/dropped_prompts"] == 0 and rows[0]["verifier/items"] == line["verifier/items"]


@pytest.mark.dist
def test_exhausted_dynamic_sampling_is_one_line(pool, tmp_path):
    # A random policy never answers right: no group has mixed accuracy, every draw is dropped.
    rows, error, _ = pool.run(_train, str(tmp_path / "run"), "none",
                              ["algorithm.name=dapo", "algorithm.dynamic_sampling=true", "algorithm.max_draws=1",
                               "checkpoint.every=0", "checkpoint.save_at_end=false", "train.steps=1"])[0]
    assert rows is None and error.startswith("error: dynamic sampling: fewer than rollout.prompts_per_step = 8 "
                                             "groups with mixed accuracy after algorithm.max_draws=1 draws"), error


# --- divergence --------------------------------------------------------------------------------------------
def _all_steps_skipped():
    """Every optimizer step reported skipped (as with a non-finite loss); checkpoint saves recorded."""
    from megatron_credit.trainer import checkpoint, step

    saved: list[int] = []
    original = step.rl_iteration

    def skipped(ctx, it):
        metrics = original(ctx, it)
        metrics["actor/skipped_steps"] = float(ctx.train.num_minibatches)
        return metrics

    originals = step.rl_iteration, checkpoint.save
    step.rl_iteration = skipped
    checkpoint.save = lambda run_dir, it, *a, **k: saved.append(it)

    def restore():
        step.rl_iteration, checkpoint.save = originals

    return restore, saved


@pytest.mark.dist
def test_consecutive_skipped_steps_stop_the_run_before_it_saves(pool, tmp_path):
    rows, error, saved = pool.run(_train, str(tmp_path / "run"), "none",
                                  ["train.steps=6", "train.max_skipped_steps=4"], _all_steps_skipped)[0]
    assert rows is None and error.startswith("error: diverged: 4 optimizer steps in a row were skipped"), error
    assert "up to iteration 2" in error and "train.max_skipped_steps=4" in error
    assert saved == [1]  # iteration 2 (the 4th skipped step) was never saved, nothing was pruned
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2]


def test_divergence_guard_counts_only_fully_skipped_iterations_and_collapse():
    import math

    from megatron_credit.trainer.divergence import DivergenceGuard

    g = DivergenceGuard(max_skipped_steps=4, steps_per_iteration=2, vocab_size=64)
    assert g.check(1, {"actor/skipped_steps": 2.0}) is None
    assert g.check(2, {"actor/skipped_steps": 1.0}) is None and g.skipped_in_a_row == 0  # a step applied
    assert g.check(3, {"actor/skipped_steps": 2.0}) is None
    assert "4 optimizer steps in a row" in g.check(4, {"actor/skipped_steps": 2.0})
    off = DivergenceGuard(max_skipped_steps=0, steps_per_iteration=2, vocab_size=64)
    assert all(off.check(i, {"actor/skipped_steps": 2.0}) is None for i in range(10))
    # A random initialisation is near uniform with any gradient: never a collapse on its own.
    c = DivergenceGuard(max_skipped_steps=4, steps_per_iteration=2, vocab_size=64)
    uniform = {"actor/entropy": math.log(64) - 1e-4, "actor/grad_norm": 0.0}
    assert c.check(1, uniform) is None and c.check(2, uniform) is None
    c = DivergenceGuard(max_skipped_steps=4, steps_per_iteration=2, vocab_size=64)
    assert c.check(1, {"actor/entropy": 0.5, "actor/grad_norm": 0.3}) is None
    assert c.check(2, uniform) is None
    message = c.check(3, uniform)
    assert message.startswith("diverged: the policy collapsed to uniform") and "ln(64) = 4.159" in message


# --- recipes refused before anything is written ---------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("optim.lr=1e38", r"optim.lr must be in \(0, 1.0\], got 1e\+38"),
    ("optim.lr=1e30", r"optim.lr must be in \(0, 1.0\]"),
    ("optim.lr=1e3", r"optim.lr must be in \(0, 1.0\]"),
    ("optim.critic_lr=1e38", r"optim.critic_lr must be in \(0, 1.0\]"),
    ("rollout.top_p=2", r"rollout.top_p must be in \(0, 1\] \(1 = off\), got 2"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\]"),
    ("rollout.top_k=-5", r"rollout.top_k must be >= 0 \(0 = off\), got -5"),
    ("train.max_skipped_steps=-1", r"train.max_skipped_steps must be >= 0"),
    ("reward.batch_timeout_s=0", r"reward.batch_timeout_s must be > 0"),
])
def test_overflowing_or_impossible_limits_are_refused_at_validation(override, message):
    from megatron_credit.recipe.config import recipe_from_dict

    with pytest.raises(ValueError, match=message):
        recipe_from_dict(TINY_CHECKPOINTED, overrides=[override])


@pytest.mark.dist
def test_bad_sampling_limit_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(TINY_CHECKPOINTED))
    proc = run_pretrain_rl("--config", tmp_path / "r.yaml", "--output-dir", tmp_path / "run", "rollout.top_p=2")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: rollout.top_p"), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"), (b"# only a comment\n", "the file is empty"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe\x00binary", "not a UTF-8 YAML text file"),
])
def test_empty_or_binary_recipe_file_is_named(tmp_path, content, message):
    from megatron_credit.recipe.config import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        load_recipe(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("model.architecture.num_attention_heads=3", r"model.architecture: num_key_value_heads=2 must divide "
                                                 r"num_attention_heads=3"),
    ("model.architecture.num_key_value_heads=3", r"num_key_value_heads=3 must divide num_attention_heads=4"),
])
def test_head_counts_the_model_cannot_have_name_their_fields(override, message):
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import check_recipe

    recipe = recipe_from_dict(TINY_CHECKPOINTED, overrides=[override])
    with pytest.raises(ValueError, match=message):
        check_recipe(recipe, recipe.model.hf_config(), world_size=1)


def test_hidden_size_not_divisible_by_heads_names_the_fields():
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import check_recipe

    recipe = recipe_from_dict(TINY_CHECKPOINTED, overrides=["model.architecture.num_attention_heads=6",
                                                 "model.architecture.num_key_value_heads=3"])
    with pytest.raises(ValueError, match=r"num_attention_heads=6 does not divide hidden_size=32"):
        check_recipe(recipe, recipe.model.hf_config(), world_size=1)


def test_a_group_of_one_sample_is_refused_for_group_relative_algorithms():
    from megatron_credit.recipe.config import recipe_from_dict
    from megatron_credit.trainer.loop import check_recipe

    recipe = recipe_from_dict(TINY_CHECKPOINTED, overrides=["rollout.n=1"])
    with pytest.raises(ValueError, match=r"rollout.n=1: algorithm grpo's advantages are relative to the group"):
        check_recipe(recipe, recipe.model.hf_config(), world_size=1)
    ppo = recipe_from_dict(TINY_CHECKPOINTED, overrides=["rollout.n=1", "algorithm.name=ppo"])
    assert check_recipe(ppo, ppo.model.hf_config(), world_size=1)["dp"] == 1  # a critic needs no group
