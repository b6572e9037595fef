"""CompPO's gate without attention sinks (``algorithm.params.gate_sink_keys``): the streamed ``H`` with the
first ``k`` keys left out equals a dense float64 reference that takes the full softmax, drops those
keys' probabilities and renormalises the rest; ``k = 0`` is the plain gate; the final-layer capture and
the recipe pass the option through.
"""
from __future__ import annotations

import pytest
import torch

from megatron_credit.models.concentration import attention_concentration
from tests.references import dense_attention
from tests.support.attention import ATTENTION_CASES, attention_inputs


def dense_sinkless(query, key, sink_keys, *, q_positions=None, scale=None):
    """``H' [B, Tq]``, ``n' [B, Tq]`` float64: full softmax ``a``, keys ``j < min(k, t)`` dropped, the rest
    renormalised (``a'_i = a_i / sum_kept a``), ``H' = mean_h sum_i a'_i**2``."""
    a = dense_attention(query, key, q_positions=q_positions, scale=scale)  # [B, Hq, Tq, Tk]
    tq, tk = a.shape[2], a.shape[3]
    pos = torch.arange(tk - tq, tk) if q_positions is None else q_positions
    keep = torch.arange(tk)[None, :] >= pos.clamp(max=sink_keys)[:, None]  # [Tq, Tk]
    kept = a * keep
    kept = kept / kept.sum(-1, keepdim=True)
    return (kept * kept).sum(-1).mean(1), ((a > 0) & keep).sum(-1)[:, 0]


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", ATTENTION_CASES)
@pytest.mark.parametrize("sink_keys", [1, 3, 40])
def test_sinkless_concentration_matches_dense_float64(b, hq, hkv, tq, tk, d, chunk, sink_keys):
    q, k = attention_inputs(b, hq, hkv, tq, tk, d, seed=sink_keys)
    k[:, :, 0] *= 6.0  # a real sink: key 0 takes much of the mass of many queries
    h, n = attention_concentration(q, k, chunk_size=chunk, sink_keys=sink_keys)
    want_h, want_n = dense_sinkless(q, k, sink_keys)
    torch.testing.assert_close(h.double(), want_h, rtol=2e-5, atol=1e-6)
    assert torch.equal(n, want_n.expand_as(n))
    plain, n0 = attention_concentration(q, k, chunk_size=chunk)
    assert not torch.allclose(h, plain)  # the option changes H where sinks matter
    pos = torch.arange(tk - tq, tk)
    assert torch.equal(n, n0 - pos.clamp(max=sink_keys))


def test_zero_sink_keys_is_the_plain_gate_and_cp_positions():
    q, k = attention_inputs(1, 4, 2, 12, 12, 8, seed=3)
    assert torch.equal(attention_concentration(q, k, sink_keys=0)[0], attention_concentration(q, k)[0])
    positions = torch.tensor([0, 1, 2, 9, 10, 11])  # a load-balanced CP shard's queries
    h, n = attention_concentration(q[:, :, positions], k, q_positions=positions, chunk_size=5, sink_keys=2)
    want_h, want_n = dense_sinkless(q[:, :, positions], k, 2, q_positions=positions)
    torch.testing.assert_close(h.double(), want_h, rtol=2e-5, atol=1e-6)
    assert n.tolist() == [[1, 1, 1, 8, 9, 10]]  # a query keeps its own key
    with pytest.raises(ValueError, match="sink_keys must be >= 0"):
        attention_concentration(q, k, sink_keys=-1)


def test_capture_passes_sink_keys_to_H_and_not_to_topk():
    from megatron_credit.models.concentration import attention_topk
    from megatron_credit.models.final_layer import FinalAttentionCapture

    q, k = attention_inputs(2, 4, 2, 10, 10, 8, seed=5)
    capture = FinalAttentionCapture()
    capture.arm(query_start=4, top_k=3, sink_keys=2)
    capture.record(q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3), scale=8 ** -0.5)
    h, _ = attention_concentration(q, k, sink_keys=2)
    assert torch.equal(capture.result["H"], h[:, 4:])
    assert torch.equal(capture.result["topk_idx"], attention_topk(q, k, 3)[0][:, 4:])
    capture.arm(query_start=4)
    assert capture.sink_keys == 0
    with pytest.raises(ValueError, match="sink_keys must be >= 0"):
        capture.arm(query_start=0, sink_keys=-2)


def test_recipe_option_reaches_the_actor_options():
    from megatron_credit.recipe.config import recipe_from_dict

    arch = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    recipe = recipe_from_dict({"model": {"architecture": arch}, "algorithm": {"name": "comppo"}},
                              overrides=["algorithm.params.gate_sink_keys=1"])
    algorithm = recipe.algorithm.build()
    assert algorithm.config.gate_sink_keys == 1
    opts = algorithm.actor_options(recipe.model.hf_config(), dtype=torch.float32)
    assert opts["capture"].sink_keys == 1
    with pytest.raises(ValueError, match="gate_sink_keys must be >= 0"):
        recipe_from_dict({"model": {"architecture": arch}, "algorithm": {"name": "comppo"}},
                         overrides=["algorithm.params.gate_sink_keys=-1"])
