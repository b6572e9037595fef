"""``pretrain_rl.py --plugin``: the README's "add an algorithm in one file" from the command line.

``examples/plugins/token_weighted_grpo.py`` registers ``token_weighted_grpo`` (GRPO with advantages
weighted by ``1 + beta * (1 - pi_old(y_t))``). Trained for 2 iterations through the real CLI: with
``beta = 0`` every non-time metric equals ``algorithm.name=grpo``'s (the side channel is all ones, so the
loss is GRPO's, bit for bit); with ``beta = 1`` the weights' mean is in (1, 2) and the update differs.
Bad ``--plugin`` values are one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tests.support.runs import VOLATILE

PLUGIN = os.path.join(ROOT, "examples", "plugins", "token_weighted_grpo.py")
TINY = ["data.min_operand=1", "data.max_operand=9", "warmup.steps=150", "rollout.prompts_per_step=8",
        "rollout.n=4", "train.steps=2", "train.val_every=0", "checkpoint.every=0", "checkpoint.save_at_end=false",
        "logging.tensorboard=false", "logging.progress=false", "logging.plots=false"]
"""The demo's recipe on one-digit sums after a short warm-up: mixed outcomes in each group, so a gradient."""


def _cli(*args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=600)


def _train(tmp_path, name, *overrides):
    out = tmp_path / name
    p = _cli("--plugin", PLUGIN, "--output-dir", str(out), "--resume", "none", *TINY,
             f"warmup.cache_dir={tmp_path / 'warmup-cache'}", *overrides)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _untimed(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


@pytest.mark.dist
@pytest.mark.slow
def test_the_example_plugin_trains_from_the_command_line_and_is_grpo_at_beta_zero(tmp_path):
    grpo = _train(tmp_path, "grpo", "algorithm.name=grpo")
    zero = _train(tmp_path, "beta0", "algorithm.name=token_weighted_grpo", "algorithm.params.beta=0")
    one = _train(tmp_path, "beta1", "algorithm.name=token_weighted_grpo", "algorithm.params.beta=1")
    assert [r["step"] for r in grpo] == [r["step"] for r in zero] == [r["step"] for r in one] == [1, 2]
    for g, z in zip(grpo, zero):
        assert z.pop("token_weighted/weight_mean") == 1.0  # every weight is exactly 1
        assert _untimed(z) == _untimed(g)
    for g, o in zip(grpo, one):
        assert 1.0 < o["token_weighted/weight_mean"] < 2.0
        assert o["actor/grad_norm"] > 0 and o["actor/skipped_steps"] == 0
    assert one[0]["accuracy/mean"] == grpo[0]["accuracy/mean"]  # the same first samples ...
    assert one[0]["actor/pg_loss"] != grpo[0]["actor/pg_loss"]  # ... a different loss on them


@pytest.mark.dist
def test_bad_plugins_are_one_line(tmp_path):
    missing = _cli("--plugin", str(tmp_path / "nope.py"), "--dry-run")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: --plugin {tmp_path / 'nope.py'}: no such file"
    unknown = _cli("--plugin", "no_such_plugin_module_xyz", "--dry-run")
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        "error: --plugin no_such_plugin_module_xyz: no such file, and no module of that name can be imported")
    bad_param = _cli("--plugin", PLUGIN, "--dry-run", "algorithm.name=token_weighted_grpo",
                     "algorithm.params.beta=-1")
    assert bad_param.returncode == 2
    assert bad_param.stderr.strip().splitlines()[-1] == "error: algorithm.params.beta must be >= 0, got -1.0"
    forgot = _cli("--dry-run", "algorithm.name=token_weighted_grpo")  # a resume without its --plugin
    assert forgot.returncode == 2 and "token_weighted_grpo" in forgot.stderr
    assert len(forgot.stderr.strip().splitlines()) == 1


def test_a_plugin_is_loaded_once_per_process(tmp_path):
    from megatron_credit.algorithm.plugins import load_plugin

    (tmp_path / "count_me.py").write_text("import builtins\nbuiltins.__dict__.setdefault('_mc_loads', []).append(1)\n")
    import builtins

    first = load_plugin(str(tmp_path / "count_me.py"))
    again = load_plugin(str(tmp_path / "count_me.py"))
    try:
        assert first is again and builtins._mc_loads == [1]
        assert first.__name__ == "megatron_credit_plugin_count_me"
    finally:
        del builtins._mc_loads
        sys.modules.pop(first.__name__, None)
