"""``pretrain_rl.py --plugin``: the README's "add an algorithm in one file" from the command line.

``examples/plugins/token_weighted_grpo.py`` registers ``token_weighted_grpo`` (GRPO with advantages
weighted by ``1 + beta * (1 - pi_old(y_t))``). Trained for 2 iterations through the real CLI: with
``beta = 0`` every non-time metric equals ``algorithm.name=grpo``'s (the side channel is all ones, so the
loss is GRPO's, bit for bit); with ``beta = 1`` the weights' mean is in (1, 2) and the update differs.
Bad ``--plugin`` values are one line.

``examples/plugins/attention_entropy_grpo.py`` reads the final layer's attention inside the behaviour pass
(a ``Capture``) and weights the advantages by its normalised collision entropy: trained the same way, its
``beta = 0`` is GRPO, metric for metric, and its entropy is checked against a loop over the attention
probabilities.
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
ENTROPY_PLUGIN = os.path.join(ROOT, "examples", "plugins", "attention_entropy_grpo.py")
TINY = ["data.min_operand=1", "data.max_operand=9", "warmup.steps=150", "rollout.prompts_per_step=8",
        "rollout.n=4", "train.steps=2", "train.val_every=0", "checkpoint.every=0", "checkpoint.save_at_end=false",
        "logging.tensorboard=false", "logging.progress=false", "logging.plots=false"]
"""The demo's recipe on one-digit sums after a short warm-up: mixed outcomes in each group, so a gradient."""


def _cli(*args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=600)


def _train(tmp_path, name, *overrides, plugin=PLUGIN):
    out = tmp_path / name
    p = _cli("--plugin", plugin, "--output-dir", str(out), "--resume", "none", *TINY,
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

    # An algorithm that reads the attention: its capture's output reaches its loss through the side channel.
    name = "algorithm.name=attention_entropy_grpo"
    e_zero = _train(tmp_path, "entropy0", name, "algorithm.params.beta=0", plugin=ENTROPY_PLUGIN)
    e_one = _train(tmp_path, "entropy1", name, "algorithm.params.beta=1", plugin=ENTROPY_PLUGIN)
    for g, z, o in zip(grpo, e_zero, e_one):
        assert 0.05 < z["attention_entropy/mean"] < 0.95  # neither one key nor uniform attention
        assert z.pop("attention_entropy/mean") == o.pop("attention_entropy/mean") or g["step"] > 1
        assert _untimed(z) == _untimed(g)  # beta = 0: GRPO, bit for bit
    assert e_one[0]["accuracy/mean"] == grpo[0]["accuracy/mean"]
    assert e_one[0]["actor/pg_loss"] != grpo[0]["actor/pg_loss"] and e_one[1]["actor/grad_norm"] > 0


def test_the_attention_entropy_capture_matches_a_loop_over_the_attention():
    import math

    import torch

    from megatron_credit.plugins import load_plugin
    from megatron_credit.models.concentration import attention_concentration

    from megatron_credit.algorithm.catalog import ALGORITHMS

    plugin = load_plugin(ENTROPY_PLUGIN)  # registers it: removed again, the built-in names stay exact
    ALGORITHMS.remove(plugin.NAME)
    sys.modules.pop(plugin.__name__, None)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 7, 8, generator=g,
                                                                               dtype=torch.float64)
    k[:, :, 3] *= 6  # one key that takes most of the attention from some queries
    h, n = attention_concentration(q, k)
    e = plugin.AttentionEntropyCapture().read({"H": h, "n": n})["attn_entropy"]
    for b in range(2):
        for t in range(7):
            h_loop = 0.0
            for head in range(4):  # GQA: query heads 0, 1 read key group 0; 2, 3 group 1
                s = [float(q[b, head, t] @ k[b, head // 2, j]) / math.sqrt(8) for j in range(t + 1)]
                z = sum(math.exp(x - max(s)) for x in s)
                h_loop += sum((math.exp(x - max(s)) / z) ** 2 for x in s) / 4
            want = 0.0 if t == 0 else -math.log(h_loop) / math.log(t + 1)
            assert float(e[b, t]) == pytest.approx(want, rel=1e-5, abs=1e-6), (b, t)
    assert float(e[:, 1:].min()) > 0 and float(e.max()) <= 1


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
    from megatron_credit.plugins import load_plugin

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
