"""The first minutes of a user: overrides anywhere on the command line, a final line that keeps
the warm-up's time apart from RL's, and a second `make demo` that says in one line that the run is done."""
from __future__ import annotations

import json
import os
import sys
import types

import pytest

from tests.support.paths import ROOT
from tests.support.runs import metrics_rows, run_pretrain_rl

sys.path.insert(0, ROOT)

import pretrain_rl  # noqa: E402


def test_overrides_before_and_after_options():
    args = pretrain_rl.parse_args(["seed=7", "--output-dir", "D", "logging.progress=false", "--dry-run", "a.b=1"])
    assert args.output_dir == "D" and args.dry_run
    assert args.overrides == ["seed=7", "logging.progress=false", "a.b=1"]
    assert pretrain_rl.parse_args([]).overrides == []


def test_done_line_separates_warm_up_and_rl_time():
    rows = [{"step": 1, "accuracy/mean": 0.25}, {"step": 2, "accuracy/mean": 0.5, "val/accuracy": 0.4},
            {"step": 3, "accuracy/mean": 0.75}]
    line = pretrain_rl.done_line(rows, {"warmup_s": 124.6, "rl_s": 404.2}, total_s=532.0, run_dir="runs/x")
    assert line.startswith("done: 3 iterations (to 3) in 404s of RL + 125s of warm-up (532s in all)")
    assert "sampled accuracy 0.250 -> 0.750, validation 0.400" in line
    assert os.path.join("runs/x", "metrics.jsonl") in line and os.path.join("runs/x", "plots") in line
    resumed = pretrain_rl.done_line(rows[2:], {"rl_s": 3.0}, total_s=9.0, run_dir="r")
    assert "1 iterations (to 3) in 3s of RL + 0s of warm-up (9s in all)" in resumed and "validation" not in resumed


def _run_dir(tmp_path, steps, rows):
    run = tmp_path / "run"
    for s in steps:
        d = run / "checkpoints" / f"iter_{s:07d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
    (run / "checkpoints" / "iter_0000200.tmp").mkdir()  # incomplete: never counts
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run)


def test_finished_line_names_the_iteration_results_and_how_to_start_again(tmp_path):
    rows = [{"step": 1, "accuracy/mean": 0.2}, {"step": 2, "accuracy/mean": 0.6, "val/accuracy": 0.55},
            {"step": 3, "accuracy/mean": 0.9}]  # step 3 logged after the last complete checkpoint
    run = _run_dir(tmp_path, [1, 2], rows)
    recipe = types.SimpleNamespace(train=types.SimpleNamespace(steps=2))
    line = pretrain_rl.finished_line(run, recipe)
    assert line.startswith(f"already finished: {run} is at iteration 2 of train.steps=2, sampled accuracy "
                           "0.600, validation 0.550;")
    assert f"remove {run} or pass --output-dir <new dir> (train.steps=N > 2 continues it)" in line
    assert "\n" not in line
    assert pretrain_rl.finished_line(run, types.SimpleNamespace(train=types.SimpleNamespace(steps=3))) is None
    assert pretrain_rl.finished_line(str(tmp_path / "none"), recipe) is None
    os.remove(os.path.join(run, "metrics.jsonl"))  # the checkpoint is what counts
    assert pretrain_rl.finished_line(run, recipe).startswith(f"already finished: {run} is at iteration 2 of "
                                                              "train.steps=2; results in")


@pytest.mark.dist
def test_a_second_run_says_it_is_done_and_a_resume_never_says_random_initialisation(tmp_path):
    out = str(tmp_path / "run")
    tiny = ["warmup.steps=0", "train.val_every=0", "rollout.prompts_per_step=8", "logging.plots=false",
            "checkpoint.every=1", "logging.tensorboard=false"]
    # options after the overrides, and overrides after the options
    first = run_pretrain_rl("train.steps=1", "--output-dir", out, *tiny, "logging.progress=false")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "actor weights: random initialisation (seed 1234)" in first.stdout
    done = [line for line in first.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and "1 iterations (to 1) in" in done[0] and "s of RL + 0s of warm-up" in done[0]
    resumed = run_pretrain_rl("--output-dir", out, *tiny, "logging.progress=false", "train.steps=2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "random initialisation" not in resumed.stdout and "resumed from" in resumed.stdout
    assert "1 iterations (to 2)" in resumed.stdout
    again = run_pretrain_rl("--output-dir", out, *tiny, "logging.progress=false", "train.steps=2")
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"already finished: {out} is at iteration 2 of train.steps=2")
    assert [r["step"] for r in metrics_rows(out)] == [1, 2]  # nothing rewritten by the third launch


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
