"""TP larger than the KV-head count (megatron-core allows TP a multiple of it): a 2-KV-head model at
TP = 4 on gloo (4 ranks) gives the logits of ``transformers`` from HF weights loaded in memory, and the
weight-sync generator gathers back the HF tensors bit for bit.

The tiny models have 4 query heads and 2 KV heads, so each rank holds one query head and a quarter of
``linear_qkv`` -- half a query group: megatron all-gathers the fused QKV output and keeps its group.
Attention is peaked (scaled q/k) so that a head or group mix-up moves the logits.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.live_export import _export_real_model, _hf_state
from tests.support.parity import TOL, _hf_logits, _make_hf_dir, _megatron_logits, _rel_err

pytestmark = pytest.mark.dist


TP = 4


pool = module_pool(TP)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tp4_with_two_kv_heads_matches_transformers(pool, tmp_path, family):
    from transformers import AutoConfig

    hf_dir = _make_hf_dir(tmp_path, family, scaled=True)
    cfg = AutoConfig.from_pretrained(hf_dir)
    assert (cfg.num_key_value_heads, cfg.num_attention_heads) == (2, 4)
    want = _hf_logits(hf_dir).logits
    results = pool.run(_megatron_logits, str(hf_dir), TP, 1)
    assert all(torch.equal(r, results[0]) for r in results)
    assert _rel_err(results[0], want) < TOL
    if family == "qwen2":  # a wrong QKV row order is caught by the same check (not vacuous at TP = 4)
        bad = pool.run(_megatron_logits, str(hf_dir), TP, 1, corrupt="qkv")[0]
        assert _rel_err(bad, want) > 100 * TOL


def test_tp4_with_two_kv_heads_weight_sync_round_trips(pool):
    _, hf = _hf_state("qwen2", tied=False)
    for out, _ in pool.run(_export_real_model, "qwen2", TP, 1):
        assert sorted(out) == sorted(hf)
        for k in hf:
            assert torch.equal(out[k], hf[k]), k
