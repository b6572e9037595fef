"""A mixture-of-experts actor (a tiny Qwen3-MoE: 4 experts, top-2) trains the same at EP = 2 as at EP = 1.

Both layouts run on two gloo ranks (DP = 2), so they see the same prompts and samples; EP = 2 splits each
layer's experts over the two ranks (megatron's all-to-all dispatcher moves the tokens). Two iterations'
reward, policy loss, gradient norm and router metrics agree to 1e-5, with packed micro-batches (the
default) and padded ones. PP = 2 with EP = 2 needs four ranks (EP groups live inside a pipeline stage):
its parity is the EP = 2, PP = 2 case below against PP = 2 alone.
"""
from __future__ import annotations

import math

import pytest

from tests.support.distributed_harness import module_pool
from tests.support.runs import train_tiny

pytestmark = pytest.mark.dist

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "moe/load_balance_loss", "moe/expert_load_max_frac")

pool2 = module_pool(2)


def train_moe(run_dir: str, overrides=()):
    """:func:`train_tiny` on :data:`TINY_MOE` (in a pool worker)."""
    from tests.support import runs

    runs.TINY = dict(runs.TINY, model={"architecture": TINY_MOE})
    return train_tiny(run_dir, "none", list(overrides))


# padded: without the warm-up (the cheaper case; its advantages are those of the untrained policy). lora:
# adapters on attention (an MoE layer's routed experts and its router stay frozen, models/lora.py)
@pytest.mark.parametrize("variant", [[], ["train.packing=false", "warmup.steps=0"], ["model.lora.rank=4", "warmup.steps=0"]],
                         ids=["packed", "padded", "lora"])
def test_expert_parallel_two_equals_one(pool2, tmp_path, variant):
    ep1 = pool2.run(train_moe, str(tmp_path / "ep1"), variant)[0]
    ep2 = pool2.run(train_moe, str(tmp_path / "ep2"), [*variant, "parallel.expert_model_parallel_size=2"])[0]
    assert len(ep1) == len(ep2) == 2
    for a, b in zip(ep1, ep2):
        for k in KEYS:
            assert math.isfinite(a[k]) and a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (k, a[k], b[k])
        assert a["actor/grad_norm"] > 0
        assert 0.25 <= a["moe/expert_load_max_frac"] <= 1.0  # 4 experts: uniform routing is 1/4
        assert a["moe/load_balance_loss"] > 0


pool4 = module_pool(4)


def test_expert_parallel_with_pipeline_parallel(pool4, tmp_path):
    """PP = 2 (a layer per stage) x DP = 2: EP = 2 splits each stage's experts over its two ranks."""
    base = ["parallel.pipeline_model_parallel_size=2", "warmup.steps=0"]
    ep1 = pool4.run(train_moe, str(tmp_path / "ep1"), base)
    ep2 = pool4.run(train_moe, str(tmp_path / "ep2"), [*base, "parallel.expert_model_parallel_size=2"])
    rows1, rows2 = ep1[0], ep2[0]  # rank 0's rows
    assert len(rows1) == len(rows2) == 2
    for a, b in zip(rows1, rows2):
        for k in KEYS:
            assert math.isfinite(a[k]) and a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (k, a[k], b[k])
        assert a["actor/grad_norm"] > 0
