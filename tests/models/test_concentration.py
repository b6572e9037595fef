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

from megatron_credit.models.concentration import attention_concentration, attention_statistics, attention_topk
from tests.references import dense_attention, dense_concentration, dense_topk
from tests.support.attention import ATTENTION_CASES, attention_inputs
from tests.support.distributed_harness import load_balanced_shard, module_pool
from tests.support.paths import ROOT


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", ATTENTION_CASES)
def test_concentration_matches_dense_float64(b, hq, hkv, tq, tk, d, chunk):
    q, k = attention_inputs(b, hq, hkv, tq, tk, d)
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


def test_concentration_large_scores_keep_float32_precision():
    """Scores of O(100) (peaked heads): H comes from max-shifted log-sum-exps, no large cancellation."""
    q, k = attention_inputs(1, 4, 2, 40, 40, 16, spread=12.0)
    h, _ = attention_concentration(q, k, chunk_size=6)
    h_ref, _ = dense_concentration(q, k)
    assert float(h_ref.min()) < 0.9 and float(h_ref.max()) > 0.99  # mixed, mostly one-hot rows
    torch.testing.assert_close(h.double(), h_ref, rtol=2e-6, atol=1e-7)


def test_concentration_bfloat16_inputs_score_in_float32():
    q, k = attention_inputs(1, 4, 2, 24, 24, 16, dtype=torch.bfloat16)
    h, _ = attention_concentration(q, k, chunk_size=5)
    torch.testing.assert_close(h.double(), dense_concentration(q, k)[0], rtol=2e-5, atol=1e-7)


def test_concentration_custom_scale_and_cp_positions():
    q, k = attention_inputs(2, 4, 2, 32, 32, 8)
    for cp in (2, 4):
        for r in range(cp):
            pos = load_balanced_shard(torch.arange(32)[None], cp, r)[0]
            h, n = attention_concentration(q[:, :, pos], k, scale=0.3, chunk_size=3, q_positions=pos)
            h_ref, n_ref = dense_concentration(q[:, :, pos], k, scale=0.3, q_positions=pos)
            torch.testing.assert_close(h.double(), h_ref, rtol=2e-5, atol=1e-7)
            assert torch.equal(n[0], pos + 1) and torch.equal(n, n_ref.expand_as(n))


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", ATTENTION_CASES)
@pytest.mark.parametrize("k", [1, 5])
def test_topk_matches_dense_float64(b, hq, hkv, tq, tk, d, chunk, k):
    q, key = attention_inputs(b, hq, hkv, tq, tk, d, seed=1)
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
    q, key = attention_inputs(1, 4, 2, 16, 16, 8, seed=3)
    pos = load_balanced_shard(torch.arange(16)[None], 2, 1)[0]
    idx, w = attention_topk(q[:, :, pos], key, 3, chunk_size=3, q_positions=pos)
    (w_ref, idx_ref), _ = dense_topk(q[:, :, pos], key, 3, q_positions=pos)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("b,hq,hkv,tq,tk,d,chunk", ATTENTION_CASES)
def test_statistics_equal_the_two_kernels_bit_for_bit(b, hq, hkv, tq, tk, d, chunk):
    """The capture's one call: H and the top-k from one shared first pass equal the two kernels' results
    exactly (the same LSEs), with CP-style query positions too; with sinks or k = 0 it is the two calls."""
    q, key = attention_inputs(b, hq, hkv, tq, tk, d, seed=4)
    pos = torch.sort(torch.randperm(tk, generator=torch.Generator().manual_seed(tq))[:tq]).values
    for kw in ({"chunk_size": chunk}, {"chunk_size": chunk, "q_positions": pos, "scale": 0.3}):
        h, n = attention_concentration(q, key, **kw)
        idx, w = attention_topk(q, key, 5, **kw)
        got = attention_statistics(q, key, 5, **kw)
        assert len(got) == 4 and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, (h, n, idx, w)))
        assert all(torch.equal(x, y) for x, y in zip(attention_statistics(q, key, 0, **kw), (h, n)))
        sunk = attention_statistics(q, key, 5, sink_keys=2, **kw)
        assert torch.equal(sunk[0], attention_concentration(q, key, sink_keys=2, **kw)[0])
        assert torch.equal(sunk[2], idx) and torch.equal(sunk[3], w)  # the top-k reads the real attention


def test_bad_inputs_name_the_field():
    q, k = attention_inputs(1, 6, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="multiple of key heads"):
        attention_concentration(q, k)
    q, k = attention_inputs(1, 4, 2, 8, 4, 8)
    with pytest.raises(ValueError, match="Tq=8 > Tk=4"):
        attention_concentration(q, k)
    with pytest.raises(ValueError, match="q_positions"):
        attention_topk(q, k, 2, q_positions=torch.arange(8))
    with pytest.raises(ValueError, match="chunk_size"):
        attention_concentration(q[:, :, :4], k, chunk_size=0)


# ------------------------------------------------------------------ (b) TP = 2 and CP = 2 on gloo


def _kernel_ranks(tp: int, cp: int):
    """On each rank of a 2-rank pool: the kernels on this rank's share (TP: heads; CP: load-balanced
    queries, all keys gathered) vs the whole problem at world size 1. Returns both to the test."""
    import torch.distributed as dist

    from megatron_credit.models.final_layer import gather_cp_sequence, scatter_to_global

    torch.set_num_threads(1)
    q, k = attention_inputs(2, 8, 2, 24, 24, 16, seed=5)
    full = dict(hk=attention_concentration(q, k, chunk_size=5), tk=attention_topk(q, k, 4, chunk_size=5))
    rank, group = dist.get_rank(), dist.group.WORLD
    if tp > 1:  # megatron's head split: rank r holds query heads r*Hq/tp.. and their key groups
        ql, kl = q.chunk(tp, dim=1)[rank], k.chunk(tp, dim=1)[rank]
        mine = dict(hk=attention_concentration(ql, kl, chunk_size=5, tp_group=group),
                    tk=attention_topk(ql, kl, 4, chunk_size=5, tp_group=group))
    else:  # CP: this rank's load-balanced queries; keys gathered back into sequence order
        ql = load_balanced_shard(q.flatten(0, 1), cp, rank).view(2, 8, -1, 16)
        kl = load_balanced_shard(k.flatten(0, 1), cp, rank).view(2, 2, -1, 16)
        keys, pos = gather_cp_sequence(kl.permute(2, 0, 1, 3), group)  # [S, b, h, d] dim order
        assert torch.equal(keys.permute(1, 2, 0, 3), k)
        h, n = attention_concentration(ql, k, chunk_size=5, q_positions=pos)
        idx, w = attention_topk(ql, k, 4, chunk_size=5, q_positions=pos)
        mine = dict(hk=(scatter_to_global(h, pos, 24, group), scatter_to_global(n, pos, 24, group)),
                    tk=(scatter_to_global(idx, pos, 24, group), scatter_to_global(w, pos, 24, group)))
    return full, mine


pool2 = module_pool(2)


@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)], ids=["tp2", "cp2"])
@pytest.mark.dist
def test_kernels_two_ranks_equal_world_size_one(pool2, tp, cp):
    for full, mine in pool2.run(_kernel_ranks, tp, cp):
        torch.testing.assert_close(mine["hk"][0], full["hk"][0], rtol=1e-6, atol=1e-7)
        assert torch.equal(mine["hk"][1], full["hk"][1])
        assert torch.equal(mine["tk"][0], full["tk"][0])
        torch.testing.assert_close(mine["tk"][1], full["tk"][1], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------- (d) the fused final layer


FUSED_BATCH, FUSED_SEQ, TOP_K = 2, 16, 4


def _fused_inputs():
    from tests.support.sharding import QWEN2

    g = torch.Generator().manual_seed(7)
    return torch.randint(0, QWEN2["vocab_size"], (FUSED_BATCH, FUSED_SEQ), generator=g)


def _forward(model, ids, pos, *, query_start=None, hook=None):
    """One forward through megatron's schedule (forward only); logits and the capture result on the
    last stage (``{}`` elsewhere). ``hook``: records the final core attention's inputs and output."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    capture = getattr(model, "final_attention_capture", None)
    armed = capture is not None and query_start is not None
    kept = {}

    def loss_func(logits):  # megatron's schedule calls it after forward_step returned (disarmed)
        kept["logits"] = logits.detach()
        if armed:
            kept.update(capture.result)
        return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

    def forward_step(data_iterator, model_chunk):
        # As the trainer does: arm, forward, disarm; the result is read in the loss function.
        if armed:
            capture.arm(query_start, TOP_K)
        try:
            return model_chunk(next(data_iterator), pos.expand(ids.shape[0], -1), None), loss_func
        finally:
            if armed:
                capture.disarm()

    handle = None
    if hook is not None and model.post_process:
        core = model.decoder.layers[-1].self_attention.core_attention
        handle = core.register_forward_hook(
            lambda m, args, out: hook.update(q=args[0].detach(), k=args[1].detach(), v=args[2].detach(),
                                             out=out.detach()))
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=FUSED_SEQ, micro_batch_size=ids.shape[0], forward_only=True)
    if handle is not None:
        handle.remove()
    return kept


def _build_pair(arch, parallel, weights=None):
    """A plain model and one with the capture, holding the same weights (``weights``: world-size-1
    tensors, sliced to this rank's TP shard with the parallel-invariance helpers)."""
    from megatron.core import parallel_state as ps

    from megatron_credit.recipe.config import ModelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from tests.support.sharding import reference_name, shard

    hf = ModelConfig(architecture=arch).hf_config()
    plain = build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel))
    fused = build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel), capture_final_attention=True)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for model in (plain, fused):
            for n, p in model.named_parameters():
                src = plain.state_dict()[n] if weights is None else weights[reference_name(model, n)]
                p.copy_(src if weights is None else shard(src, p, tp_rank, tp))
    assert plain.final_attention_capture is None
    return plain, fused


def _dense_from_hook(hook, query_start):
    """Dense float64 H, n, top-k of the final layer from the q/k megatron handed its core attention,
    and the core attention's output recomputed from those probabilities (proves q/k are what it used)."""
    q, k, v = (hook[x].permute(1, 2, 0, 3) for x in ("q", "k", "v"))  # [b, h, S, d]
    a = dense_attention(q, k)
    out = (a @ v.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1))  # [b, np, S, d]
    out = out.permute(2, 0, 1, 3).reshape(hook["out"].shape)
    h, n = dense_concentration(q[:, :, query_start:], k, q_positions=torch.arange(query_start, q.shape[2]))
    qpos = torch.arange(query_start, q.shape[2])
    (w, idx), _ = dense_topk(q[:, :, query_start:], k, TOP_K, q_positions=qpos)
    idx = torch.where(w == 0, qpos[None, :, None], idx)  # rows with < TOP_K visible keys: padding
    return dict(H=h, n=n.expand_as(h), topk_w=w, topk_idx=idx, out=out, out_hook=hook["out"])


def _fused_case(arch, tp, pp, cp, query_start):
    """World size 1 (every rank) and then the sharded pair; returns what the test compares."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.models.concentration import attention_concentration, attention_topk
    from megatron_credit.models.cpu_attention import load_balanced_positions
    from tests.support.sharding import VOCAB_SHARDED, unshard

    torch.set_num_threads(1)
    ids = _fused_inputs()
    distributed.initialize(ParallelConfig(), seed=11)
    plain, fused = _build_pair(arch, ParallelConfig())
    hook = {}
    ref = _forward(plain, ids, torch.arange(FUSED_SEQ), hook=hook)
    got = _forward(fused, ids, torch.arange(FUSED_SEQ), query_start=query_start)
    kept_result = fused.final_attention_capture.result
    unarmed = _forward(fused, ids, torch.arange(FUSED_SEQ))
    # An unarmed forward computes nothing: the last result is the same object, untouched.
    untouched = fused.final_attention_capture.result is kept_result and kept_result is not None
    q, k = (hook[x].permute(1, 2, 0, 3) for x in ("q", "k"))
    qpos = torch.arange(query_start, FUSED_SEQ)
    ws1 = dict(logits_equal=torch.equal(ref["logits"], got["logits"]) and torch.equal(ref["logits"],
                                                                                        unarmed["logits"]),
               unarmed_empty=set(unarmed) == {"logits"} and untouched, got=got, dense=_dense_from_hook(hook, query_start),
               kernel=attention_concentration(q[:, :, query_start:], k, q_positions=qpos)
               + attention_topk(q[:, :, query_start:], k, TOP_K, q_positions=qpos))
    ws1["classes"] = ([type(layer.self_attention.core_attention).__name__ for layer in plain.decoder.layers],
                      [type(layer.self_attention.core_attention).__name__ for layer in fused.decoder.layers])
    weights = {n: p.detach().clone() for n, p in plain.named_parameters()}
    distributed.destroy()

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp)
    distributed.initialize(parallel, seed=11)
    plain, fused = _build_pair(arch, parallel, weights)
    pos = load_balanced_positions(FUSED_SEQ // cp, cp_rank=ps.get_context_parallel_rank(), cp_size=cp)
    p_out = _forward(plain, ids[:, pos], pos)
    f_out = _forward(fused, ids[:, pos], pos, query_start=query_start)
    mine = dict(present=fused.final_attention_capture.present, last=fused.post_process)
    if "logits" in f_out:
        mine.update(logits_equal=torch.equal(p_out["logits"], f_out["logits"]), pos=pos,
                    logits=unshard(f_out["logits"], VOCAB_SHARDED, ps.get_tensor_model_parallel_group()),
                    got={x: f_out[x] for x in ("H", "n", "topk_idx", "topk_w")})
    distributed.destroy()
    dist.barrier()
    return ws1, mine


def _check_stats(got, want, *, rtol, atol):
    torch.testing.assert_close(got["H"].double(), want["H"].double(), rtol=rtol, atol=atol)
    assert torch.equal(got["n"], want["n"].to(got["n"].dtype))
    assert torch.equal(got["topk_idx"], want["topk_idx"])
    torch.testing.assert_close(got["topk_w"].double(), want["topk_w"].double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("kv_heads,tp,pp,cp,query_start",
                         [(2, 2, 1, 1, 5), (1, 2, 1, 1, 3), (2, 1, 1, 2, 5), (2, 1, 2, 1, 2), (2, 1, 1, 2, 13)],
                         ids=["tp2", "tp2-one-kv-head", "cp2", "pp2", "cp2-late-start"])
@pytest.mark.dist
def test_fused_final_layer(pool2, kv_heads, tp, pp, cp, query_start):
    """tp2-one-kv-head: TP above the KV-head count, each rank holds its own copy of the one group."""
    from tests.support.sharding import QWEN2

    results = pool2.run(_fused_case, dict(QWEN2, num_key_value_heads=kv_heads), tp, pp, cp, query_start)
    ws1 = results[0][0]
    # World size 1: logits bit-identical with and without the capture (armed or not) ...
    assert ws1["logits_equal"] and ws1["unarmed_empty"]
    # Only the last layer's core attention is replaced, by a subclass of the spec's own class.
    assert ws1["classes"] == (["DotProductAttention"] * 2, ["DotProductAttention", "CapturingDotProductAttention"])
    # ... the core attention's own output is the dense softmax of the q/k the capture sees ...
    torch.testing.assert_close(ws1["dense"].pop("out_hook").double(), ws1["dense"].pop("out"),
                               rtol=1e-5, atol=1e-6)
    # ... and H / n / top-k equal the kernels and the dense float64 reference on those q/k.
    kernel = dict(zip(("H", "n", "topk_idx", "topk_w"), ws1["kernel"]))
    _check_stats(ws1["got"], kernel, rtol=0, atol=0)
    _check_stats(ws1["got"], ws1["dense"], rtol=2e-5, atol=1e-7)
    assert ws1["got"]["H"].shape == (FUSED_BATCH, FUSED_SEQ - query_start)
    # Sharded: bit-identical logits vs the sharded plain model; the same stats on every rank that
    # holds the last layer, equal to world size 1 (float32 TP / CP reduction order: 1e-5).
    last = [mine for _, mine in results if mine["last"]]
    assert [mine["present"] for _, mine in results] == [mine["last"] for _, mine in results]
    assert last and all(mine["logits_equal"] for mine in last)
    for mine in last:
        torch.testing.assert_close(mine["logits"], ws1["got"]["logits"][:, mine["pos"]], rtol=1e-5, atol=1e-5)
        _check_stats(mine["got"], ws1["got"], rtol=1e-5, atol=1e-6)
        for x in mine["got"]:  # identical on every TP / CP rank
            assert torch.equal(mine["got"][x], last[0]["got"][x])


# -------------------------------------------------------------------------- (c) peak extra memory

# How memory is measured (CPU): a fresh subprocess builds the inputs, resets the resident-set
# high-water mark (writing 5 to /proc/self/clear_refs, Linux >= 4.0), runs the kernel once and reports
# VmHWM - VmRSS-before: the peak of everything the call allocated and touched (after a tiny warm-up
# call, so that library code paged in on first use is not counted). glibc would keep freed
# blocks above its (growing) mmap threshold in the heap; MALLOC_MMAP_THRESHOLD_=65536 pins the
# threshold, so every large tensor is its own mapping and is returned when freed. The probe is checked
# against a materialised softmax, which it must see. Peak on GPU: torch.cuda.max_memory_allocated.
_PROBE = """
import sys, torch
from megatron_credit.models.concentration import attention_concentration, attention_topk
def kib(field):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(field))
b, hq, hkv, tq, tk, d, what = {args!r}
q, k = torch.randn(b, hq, tq, d), torch.randn(b, hkv, tk, d)
fn = dict(conc=lambda q, k: attention_concentration(q, k), topk=lambda q, k: attention_topk(q, k, 64),
          dense=lambda q, k: torch.softmax(q.reshape(b, hkv, -1, d) @ k.transpose(-1, -2), dim=-1))[what]
fn(q[:, :, :64], k[:, :, :64])  # warm-up: library code pages touched once are not the kernel's memory
open('/proc/self/clear_refs', 'w').write('5')
base = kib('VmRSS')
out = fn(q, k)
print((kib('VmHWM') - base) * 1024)
"""


def _peak_bytes(b, hq, hkv, tq, tk, d, what):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", _PROBE.format(args=(b, hq, hkv, tq, tk, d, what))],
                         capture_output=True, text=True, check=True, env=env, timeout=900)
    return int(res.stdout.strip().splitlines()[-1])


MB = 1 << 20
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc only")


@needs_proc
@pytest.mark.spawn
def test_peak_memory_does_not_grow_with_sequence_length():
    """Peak extra memory is set by the chunk (one [B, Hq, c, c] float32 tile and its temporaries), not
    by Tq * Tk: doubling T adds only the O(B * Tq) outputs. The probe sees a dense softmax."""
    small = _peak_bytes(1, 8, 2, 2048, 2560, 64, "conc")
    large = _peak_bytes(1, 8, 2, 4096, 5120, 64, "conc")
    dense = _peak_bytes(1, 8, 2, 2048, 2560, 64, "dense")  # 8 * 2048 * 2560 * 4 B = 160 MiB per buffer
    assert dense >= 160 * MB, dense
    assert large < small + 8 * MB, (small, large)
    assert large < 256 * MB, large


@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("what", ["conc", "topk"])
@pytest.mark.spawn
def test_peak_memory_bound_at_full_size(what):
    """The issue's bound at its size: B=1, Hq=8, Hkv=2, D=64, Tq=16384, Tk=20480, fp32: < 512 MB
    (dense: one [8, 16384, 20480] float32 score matrix is 10 GiB). ~80 s (conc) on one core."""
    if what == "topk":  # the sort-based merge is ~3x slower on CPU: same bound, a quarter of the rows
        peak = _peak_bytes(1, 8, 2, 4096, 20480, 64, what)
    else:
        peak = _peak_bytes(1, 8, 2, 16384, 20480, 64, what)
    assert peak < 512 * MB, peak / MB


def test_capture_arm_checks_and_result_lifetime():
    from megatron_credit.models.final_layer import FinalAttentionCapture

    capture = FinalAttentionCapture()
    with pytest.raises(ValueError, match="query_start"):
        capture.arm(-1, 4)
    with pytest.raises(ValueError, match="top_k"):
        capture.arm(0, -1)
    with pytest.raises(ValueError, match="chunk_size"):
        FinalAttentionCapture(chunk_size=0)
    capture.result = {"H": torch.ones(1)}
    capture.disarm()  # keeps the result (read in the loss function after the forward)
    assert not capture.armed and capture.result is not None
    capture.arm(3, 2)  # clears it
    assert capture.armed and capture.result is None and (capture.query_start, capture.top_k) == (3, 2)


@pytest.mark.parametrize("top_k,sink_keys", [(3, 0), (3, 2), (0, 0)])
def test_packed_capture_equals_a_call_per_sequence_bit_for_bit(top_k, sink_keys):
    """A packed stream's capture stacks the sequences of one length into one call: every sequence's rows
    equal the kernels called on that sequence alone, exactly; zeros before query_start and past its end;
    a sequence too short to hold a query stays zero."""
    from types import SimpleNamespace

    from megatron_credit.batch.packing import PackedIndex
    from megatron_credit.models.final_layer import FinalAttentionCapture

    lens, query_start, scale = [12, 20, 12, 5, 20, 12], 6, 8 ** -0.5
    q, k = attention_inputs(1, 4, 2, sum(lens), sum(lens), 8, seed=6)
    query, key = q[0].permute(1, 0, 2), k[0].permute(1, 0, 2)  # THD: [t, np, d], [t, ng, d]
    cu = PackedIndex.build(lens).cu_seqlens
    params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
                             cu_seqlens_kv_padded=None)
    capture = FinalAttentionCapture(chunk_size=7)
    capture.arm(query_start, top_k, sink_keys)
    capture.record(query, key, scale=scale, packed_seq_params=params)
    got = capture.result
    assert set(got) == ({"H", "n", "topk_idx", "topk_w"} if top_k else {"H", "n"})
    assert all(x.shape[:2] == (len(lens), max(lens)) for x in got.values())
    for s, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        if n <= query_start:
            assert all((x[s] == 0).all() for x in got.values())
            continue
        qs, ks = q[:, :, start + query_start:start + n], k[:, :, start:start + n]
        kw = dict(scale=scale, chunk_size=7, q_positions=torch.arange(query_start, n))
        want = dict(zip(("H", "n"), attention_concentration(qs, ks, sink_keys=sink_keys, **kw)))
        if top_k:
            want.update(zip(("topk_idx", "topk_w"), attention_topk(qs, ks, top_k, **kw)))
        for name, x in want.items():
            assert torch.equal(got[name][s, query_start:n], x[0]), (s, name)
            assert (got[name][s, :query_start] == 0).all() and (got[name][s, n:] == 0).all()
