"""Packed micro-batches (``train.packing``) against padded rows on the trainer's fixed batch (gloo).

The same two optimizer steps (``tests/support/fixed_batch.py``: behaviour pass, advantages, two
mini-batches, the second one off-policy so FIPO's weights and PPO's value clip act) run once with padded
rows and once packed, at world size 1 and at TP 2 (+SP), PP 2, CP 2 and DP 2. Every metric (losses,
gradient norms, entropies, KL, FIPO's weights, the critic's loss), the advantages and returns, and
CompPO's gates, dynamic gates, top-K keys and weights, and critic values must agree to 1e-5
relative in fp32 (1e-7 absolute for values near 0, such as a GRPO loss whose advantages cancel, as in
``tests/trainer/test_step.py``); the packed run must compute no padding rows (only the CP / SP alignment).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.fixed_batch import _run_fixed

pytestmark = pytest.mark.dist

pool1 = module_pool(1)
pool2 = module_pool(2)

LAYOUTS = {"world 1": {}, "TP=2+SP": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "PP=2": {"pipeline_model_parallel_size": 2}, "CP=2": {"context_parallel_size": 2}, "DP=2": {}}
RTOL, ATOL = 1e-5, 1e-7


def _advantages(batch, plan):
    """The advantages of this rank's rows (and returns, with a critic), as per-step metrics."""
    if batch.advantages is None:  # not the last pipeline stage
        return {}
    m = batch.loss_mask
    out = {"adv/abs_sum": float(torch.where(m, batch.advantages, 0.0).abs().sum()),
           "adv/sq_sum": float(torch.where(m, batch.advantages, 0.0).pow(2).sum())}
    for name in ("returns", "values", "kappa", "gates"):  # critic values, CompPO's gates
        t = batch.extras.get(name, getattr(batch, name, None))
        if t is not None:
            out[f"adv/{name}_sum"] = float(torch.where(m, t, 0.0).sum())
    if "topk_w" in batch.extras:  # CompPO: the keys its critic reads, and their weights
        out["adv/topk_w_sum"] = float(torch.where(m[..., None], batch.extras["topk_w"], 0.0).sum())
        out["adv/topk_idx_sum"] = float(torch.where(m[..., None], batch.extras["topk_idx"], 0).sum())
    return out


def max_rel_diff(padded: list[dict], packed: list[dict]) -> tuple[float, str]:
    """The largest difference over every shared numeric metric of every step in units of its tolerance
    (``max(RTOL |x|, ATOL)``; <= 1 passes), and where it is."""
    worst, where = 0.0, ""
    for i, (a, b) in enumerate(zip(padded, packed)):
        for k, x in a.items():
            if k.startswith(("throughput/", "time/")) or not isinstance(x, float) or k not in b:
                continue
            d = abs(b[k] - x) / max(RTOL * abs(x), ATOL)
            if d > worst:
                worst, where = d, f"step {i} {k}: padded {x} packed {b[k]}, relative {abs(b[k] - x) / max(abs(x), 1e-30):.1e}"
    return worst, where


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "fipo", "ppo", "comppo", "comppo_fipo", "gspo", "dr_grpo",
                                       "rloo"])
def test_a_packed_update_equals_the_padded_one(pool1, pool2, algorithm, layout):
    pool = pool1 if layout == "world 1" else pool2
    # CompPO: the final layer's statistics per sequence (keys of its own sequence only), the TAC critic
    # reading each sequence's own history (one fused layer: a PP=2 stage holds one of the two)
    extra = ["algorithm.params.critic_layers=1"] if algorithm.startswith("comppo") else []
    runs = {p: pool.run(_run_fixed, LAYOUTS[layout], algorithm, overrides=[f"train.packing={p}", *extra],
                        prepare=_advantages)[0] for p in ("false", "true")}
    padded, packed = runs["false"], runs["true"]
    assert set(padded[0]) - {"throughput/padding_fraction"} <= set(packed[0])
    assert padded[1]["actor/logp_diff_abs"] > 0  # the second step is off-policy: its weights and clips act
    worst, where = max_rel_diff(padded, packed)
    assert worst <= 1.0, f"{algorithm} {layout}: {where}"
    if layout != "PP=2":  # rank 0 is the first stage there, which computes no advantages
        assert packed[0]["adv/abs_sum"] > 0
        if algorithm.startswith("comppo"):
            assert packed[0]["adv/kappa_sum"] > 0 and packed[0]["adv/topk_w_sum"] > 0
    if layout in ("world 1", "PP=2", "DP=2"):  # no alignment: not one token of padding
        assert all(r["throughput/padding_fraction"] == 0.0 for r in packed)
    assert all(r["throughput/padding_fraction"] < p["throughput/padding_fraction"] for r, p in zip(packed, padded))
