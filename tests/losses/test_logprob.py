"""Vocab-parallel log-probs + entropy against a float64 loop reference, and TP=2/4 on gloo == TP=1."""
import pytest
import torch

from megatron_credit.losses.logprob import logprobs_and_entropy, logprobs_from_hidden
from tests.references import logprob_entropy_reference
from tests.support.distributed_harness import block_subgroup
from tests.support.threaded_harness import gloo_and_threads_pool

F64 = torch.float64


def _loss(logp, ent, g_logp, g_ent):
    return (logp * g_logp).sum() + (0 if ent is None else (ent * g_ent).sum())


def _data(batch, seq, vocab, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, seq, vocab, generator=gen, dtype=F64)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    g_logp = torch.randn(batch, seq, generator=gen, dtype=F64)
    g_ent = torch.randn(batch, seq, generator=gen, dtype=F64)
    return logits, labels, g_logp, g_ent


def _ref_with_grad(logits, labels, g_logp, g_ent, temperature=1.0):
    x = logits.detach().to(F64).requires_grad_()
    logp, ent = logprob_entropy_reference(x, labels, temperature)
    _loss(logp, ent, g_logp, g_ent).backward()
    return logp.detach(), ent.detach(), x.grad


# ------------------------------------------------------------------------------------- single process
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference_forward_and_backward(chunk_size, temperature):
    logits, labels, g_logp, g_ent = _data(2, 9, 11)  # 18 tokens: 3 and 7 do not divide it
    ref_logp, ref_ent, ref_grad = _ref_with_grad(logits, labels, g_logp, g_ent, temperature)
    x = logits.clone().requires_grad_()
    logp, ent = logprobs_and_entropy(x, labels, chunk_size=chunk_size, temperature=temperature)
    _loss(logp, ent, g_logp, g_ent).backward()
    assert logp.dtype == F64 and ent.dtype == F64 and logp.shape == (2, 9)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=1e-12)


def test_gradcheck_logits_and_hidden():
    logits, labels, _, _ = _data(2, 3, 5, seed=1)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: logprobs_and_entropy(x, labels, chunk_size=4, temperature=0.8), (x,))
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 3, 4, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs_from_hidden(h, w, labels, chunk_size=4, temperature=1.3), (h, w))


def test_entropy_off_and_single_output_gradients():
    logits, labels, g_logp, g_ent = _data(3, 4, 6, seed=3)
    x = logits.clone().requires_grad_()
    logp, ent = logprobs_and_entropy(x, labels, chunk_size=5, compute_entropy=False)
    assert ent is None
    (logp * g_logp).sum().backward()
    xr = logits.clone().requires_grad_()
    ref_logp, _ = logprob_entropy_reference(xr, labels)
    (ref_logp * g_logp).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)

    # Only the entropy reaches the loss: logp's gradient arrives as None and must count as zero.
    x.grad = None
    _, ent = logprobs_and_entropy(x, labels, chunk_size=5)
    (ent * g_ent).sum().backward()
    xr.grad = None
    _, ref_ent = logprob_entropy_reference(xr, labels)
    (ref_ent * g_ent).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)


def test_non_contiguous_logits():
    logits, labels, g_logp, g_ent = _data(3, 5, 7, seed=4)
    strided = logits.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # [B, T, V], T-major
    assert not strided.is_contiguous()  # [B*T, V] is not a view: the chunk-copy path
    logp, ent = logprobs_and_entropy(strided, labels, chunk_size=4)
    _loss(logp, ent, g_logp, g_ent).backward()
    ref_logp, ref_ent, ref_grad = _ref_with_grad(logits, labels, g_logp, g_ent)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(strided.grad, ref_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_are_not_modified_and_return_fp32(dtype):
    logits, labels, g_logp, g_ent = _data(2, 6, 13, seed=5, dtype=dtype)
    before = logits.clone()
    x = logits.requires_grad_()
    logp, ent = logprobs_and_entropy(x, labels, chunk_size=5, temperature=0.9)
    _loss(logp, ent, g_logp.float(), g_ent.float()).backward()
    assert torch.equal(logits.detach(), before)  # megatron's cross-entropy would have shifted them
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and x.grad.dtype == dtype
    # Reference on exactly the same (rounded) input values: only fp32 arithmetic error remains.
    ref_logp, ref_ent, ref_grad = _ref_with_grad(before, labels, g_logp, g_ent, 0.9)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
    grad_tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: 8 bits of mantissa in the output
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=grad_tol, atol=grad_tol)


def test_extreme_logits_are_stable():
    logits, labels, _, _ = _data(1, 4, 9, seed=6)
    logits = logits * 1e4
    x = logits.clone().requires_grad_()
    logp, ent = logprobs_and_entropy(x, labels, chunk_size=3)
    (logp.sum() + ent.sum()).backward()
    ref_logp, ref_ent = logprob_entropy_reference(logits, labels)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-9)
    assert torch.isfinite(x.grad).all()


def test_fp32_entropy_is_precise_for_large_offset_logits():
    # Logits near 100 in fp32: H = lse - E_p[z] subtracts two ~100 numbers (ulp ~8e-6); the entropy must
    # instead come from shifted logits, H = log S - E_p[z - m], precise to a few fp32 ulps of H itself.
    logits, labels, _, _ = _data(4, 16, 257, seed=11)
    logits32 = (logits + 100.0).float()
    ref_logp, ref_ent = logprob_entropy_reference(logits32.double(), labels)
    for chunk_size in (5, 1024):
        logp, ent = logprobs_and_entropy(logits32, labels, chunk_size=chunk_size)
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-6)
        torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=3e-5)  # lse itself is ~100


@pytest.mark.parametrize("chunk_size", [2, 5, 1024])
def test_hidden_matches_reference(chunk_size):
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 5, 6, generator=gen, dtype=F64)
    w = torch.randn(9, 6, generator=gen, dtype=F64)
    labels = torch.randint(0, 9, (2, 5), generator=gen)
    g_logp, g_ent = torch.randn(2, 5, generator=gen, dtype=F64), torch.randn(2, 5, generator=gen, dtype=F64)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_ent = logprob_entropy_reference(hr @ wr.t(), labels, 0.8)
    _loss(ref_logp, ref_ent, g_logp, g_ent).backward()
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = logprobs_from_hidden(hx, wx, labels, chunk_size=chunk_size, temperature=0.8)
    _loss(logp, ent, g_logp, g_ent).backward()
    for got, want in [(logp, ref_logp), (ent, ref_ent), (hx.grad, hr.grad), (wx.grad, wr.grad)]:
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-11)


def test_hidden_bf16_close_to_fp32_and_weight_only_grad():
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(2, 7, 16, generator=gen).bfloat16()
    w = (0.3 * torch.randn(33, 16, generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, 33, (2, 7), generator=gen)
    logp, ent = logprobs_from_hidden(h, w, labels, chunk_size=4)  # hidden needs no grad
    (logp.sum() + ent.sum()).backward()
    assert logp.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    logits = (h @ w.detach().t()).double().requires_grad_()  # the same bf16 matmul, then exact math
    ref_logp, ref_ent = logprob_entropy_reference(logits, labels)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    (ref_logp.sum() + ref_ent.sum()).backward()
    ref_gw = logits.grad.flatten(0, 1).t() @ h.double().flatten(0, 1)  # [V, B*T] @ [B*T, H]
    torch.testing.assert_close(w.grad.double(), ref_gw, rtol=3e-2, atol=3e-2)


def test_argument_errors():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="labels must be"):
        logprobs_and_entropy(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_and_entropy(x, torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy(x, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="output_weight"):
        logprobs_from_hidden(x, torch.zeros(5, 3), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.gpu
def test_cuda_peak_memory_is_grad_plus_a_few_chunks():
    """On CUDA the allocator's peak is exact: the bf16 grad plus O(chunk) fp32, no full fp32 copy."""
    batch, seq, vocab, chunk = 1, 4096, 32768, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, seq, vocab, device="cuda", generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, ent = logprobs_and_entropy(logits, labels, chunk_size=chunk)
    (logp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logits_bytes = logits.numel() * 2
    assert peak < logits_bytes + 4 * chunk * vocab * 4 < 2 * logits_bytes  # < one full fp32 copy
    ls = torch.log_softmax(logits.detach().float(), dim=-1)
    torch.testing.assert_close(logp, ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1), rtol=0, atol=1e-3)


# ------------------------------------------------------------------------------------- TP on gloo
WORLD = 4


pool = gloo_and_threads_pool(WORLD)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


_tp_group = block_subgroup


def _tp_logits_worker(tp, logits, labels, g_logp, g_ent, chunk_size, temperature):
    group, r = _tp_group(tp)
    v_local = logits.shape[-1] // tp
    shard = logits[..., r * v_local:(r + 1) * v_local].clone().requires_grad_()
    logp, ent = logprobs_and_entropy(shard, labels, tp_group=group, chunk_size=chunk_size,
                                     temperature=temperature)
    _loss(logp, ent, g_logp, g_ent).backward()
    return logp.detach(), ent.detach(), shard.grad


def _tp_hidden_worker(tp, hidden, weight, labels, g_logp, g_ent, chunk_size):
    group, r = _tp_group(tp)
    v_local = weight.shape[0] // tp
    h = hidden.clone().requires_grad_()
    w = weight[r * v_local:(r + 1) * v_local].clone().requires_grad_()
    logp, ent = logprobs_from_hidden(h, w, labels, tp_group=group, chunk_size=chunk_size)
    _loss(logp, ent, g_logp, g_ent).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _boundary_labels(batch, seq, vocab, tp, gen):
    """Labels on both sides of every shard boundary, plus random ones."""
    v_local = vocab // tp
    edges = sorted({e for r in range(tp) for e in (r * v_local, r * v_local + v_local - 1)})
    labels = torch.randint(0, vocab, (batch * seq,), generator=gen)
    labels[:len(edges)] = torch.tensor(edges)
    return labels.view(batch, seq)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_logits_equal_tp1(pool, tp):
    gen = torch.Generator().manual_seed(10 + tp)
    batch, seq, vocab = 2, 7, 16
    logits = 3 * torch.randn(batch, seq, vocab, generator=gen, dtype=F64)
    labels = _boundary_labels(batch, seq, vocab, tp, gen)
    g_logp, g_ent = torch.randn(batch, seq, generator=gen, dtype=F64), torch.randn(batch, seq, generator=gen,
                                                                                   dtype=F64)
    x = logits.clone().requires_grad_()
    logp1, ent1 = logprobs_and_entropy(x, labels, chunk_size=3, temperature=0.9)
    _loss(logp1, ent1, g_logp, g_ent).backward()
    ref_logp, ref_ent, ref_grad = _ref_with_grad(logits, labels, g_logp, g_ent, 0.9)
    torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=1e-12)

    out = pool.run(_tp_logits_worker, tp, logits, labels, g_logp, g_ent, 3, 0.9)
    v_local = vocab // tp
    for rank, (logp, ent, grad) in enumerate(out):
        r = rank % tp
        torch.testing.assert_close(logp, logp1.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, ent1.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, x.grad[..., r * v_local:(r + 1) * v_local], rtol=0, atol=1e-12)
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_hidden_equal_tp1(pool, tp):
    gen = torch.Generator().manual_seed(20 + tp)
    batch, seq, hid, vocab = 2, 5, 6, 16
    hidden = torch.randn(batch, seq, hid, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hid, generator=gen, dtype=F64)
    labels = _boundary_labels(batch, seq, vocab, tp, gen)
    g_logp, g_ent = torch.randn(batch, seq, generator=gen, dtype=F64), torch.randn(batch, seq, generator=gen,
                                                                                   dtype=F64)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp1, ent1 = logprobs_from_hidden(h1, w1, labels, chunk_size=4)
    _loss(logp1, ent1, g_logp, g_ent).backward()

    out = pool.run(_tp_hidden_worker, tp, hidden, weight, labels, g_logp, g_ent, 4)
    v_local = vocab // tp
    for rank, (logp, ent, gh, gw) in enumerate(out):
        r = rank % tp
        torch.testing.assert_close(logp, logp1.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, ent1.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(gh, h1.grad, rtol=0, atol=1e-12)  # complete: all-reduced inside
        torch.testing.assert_close(gw, w1.grad[r * v_local:(r + 1) * v_local], rtol=0, atol=1e-12)


# ------------------------------------------------------------------- mutation killers
def test_bad_arguments_are_refused_with_the_shapes_named():
    x, labels = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^logits must be \[B, T, D\], got shape \(2, 3\)$"):
        logprobs_and_entropy(x[:, :, 0], labels)
    with pytest.raises(ValueError, match=r"^labels must be \[B, T\] = \(2, 3\), got \(2, 4\)$"):
        logprobs_and_entropy(x, torch.zeros(2, 4, dtype=torch.long))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(ValueError, match=rf"^labels must be integer token ids, got {dtype}$"):
            logprobs_and_entropy(x, labels.to(dtype))
    with pytest.raises(ValueError, match=r"^hidden must be \[B, T, D\], got shape \(2, 3\)$"):
        logprobs_from_hidden(x[:, :, 0], torch.randn(7, 5), labels)


@pytest.mark.parametrize("temperature", [2.0, 0.5])
def test_gradients_at_a_temperature_of_two(temperature):
    # The chunked backward divides the logits' gradient by the temperature (any T != 1, 2.0 included).
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    logp, ent = logprobs_and_entropy(logits, labels, chunk_size=3, temperature=temperature)
    (logp.sum() + 0.3 * ent.sum()).backward()
    ref = logits.detach().clone().requires_grad_(True)
    lsm = torch.log_softmax(ref / temperature, dim=-1)
    ref_logp = lsm.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_log_probs_without_entropy_are_the_same_log_probs():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 6, 8, dtype=torch.float64, generator=g)
    weight = torch.randn(13, 8, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 13, (2, 6), generator=g)
    for fn, args in ((logprobs_and_entropy, (hidden @ weight.T,)), (logprobs_from_hidden, (hidden, weight))):
        with_ent, ent = fn(*args, labels, chunk_size=5)
        alone, none = fn(*args, labels, chunk_size=5, compute_entropy=False)
        assert none is None and ent is not None
        torch.testing.assert_close(alone, with_ent, rtol=0, atol=0)
        ref = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(alone, ref, rtol=1e-12, atol=1e-12)


def test_non_contiguous_inputs_for_every_chunk_boundary():
    # The trainer passes hidden states as [s, b, H].transpose(0, 1): not viewable as [b*s, H], so chunks are
    # copied row piece by row piece. Every chunk size from 1 to past a row (chunks that end one token into a
    # row, that straddle rows) gives the contiguous result, forward and backward.
    g = torch.Generator().manual_seed(5)
    b, s, d, v = 3, 4, 6, 9
    hidden = torch.randn(s, b, d, dtype=torch.float64, generator=g).transpose(0, 1)
    weight = torch.randn(v, d, dtype=torch.float64, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    assert not hidden.is_contiguous()
    ref_h = hidden.contiguous().requires_grad_(True)
    ref_logp, ref_ent = logprobs_from_hidden(ref_h, weight, labels, chunk_size=b * s)
    (ref_logp.sum() + ref_ent.sum()).backward()
    for chunk in range(1, s + 3):
        h = hidden.detach().clone().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)
        assert not h.is_contiguous()
        logp, ent = logprobs_from_hidden(h, weight, labels, chunk_size=chunk)
        (logp.sum() + ent.sum()).backward()
        torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12, msg=f"chunk {chunk}")
        torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-12, atol=1e-12, msg=f"chunk {chunk}")


def _tp_large_logits_worker(tp, logits, labels):
    group, r = _tp_group(tp)
    v_local = logits.shape[-1] // tp
    logp, ent = logprobs_and_entropy(logits[..., r * v_local:(r + 1) * v_local].contiguous(), labels,
                                     tp_group=group, chunk_size=4)
    return logp, ent


def test_tp_float32_log_probs_of_large_logits(pool):
    # The log-sum-exp shift is the max over the *whole* vocabulary (a MAX all-reduce over TP): float32 logits
    # around 60 on each of 4 shards stay finite and exact (a shift summed over shards, 240, would underflow
    # exp(z - shift) to 0 and give -inf).
    gen = torch.Generator().manual_seed(31)
    logits = (60 + torch.randn(2, 5, 16, generator=gen)).float()
    labels = _boundary_labels(2, 5, 16, 4, gen)
    ref = torch.log_softmax(logits.double(), dim=-1)
    ref_logp = ref.gather(-1, labels[..., None]).squeeze(-1)
    for logp, ent in pool.run(_tp_large_logits_worker, 4, logits, labels):
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)


def test_output_weight_mismatches_are_named():
    hidden, labels = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^output_weight must be \[V_local, H=8\]"):
        logprobs_from_hidden(hidden, torch.randn(5, 7), labels)
    with pytest.raises(ValueError, match=r"^output_weight dtype torch.float64 != hidden dtype torch.float32$"):
        logprobs_from_hidden(hidden, torch.randn(5, 8, dtype=torch.float64), labels)


@pytest.mark.parametrize("trainable", ["hidden", "weight"])
def test_only_the_input_that_needs_a_gradient_gets_one(trainable):
    # A frozen output layer (a critic's, a reference model's) or frozen hidden states: the other input's
    # gradient is still the full one.
    g = torch.Generator().manual_seed(32)
    hidden = torch.randn(2, 5, 6, dtype=torch.float64, generator=g)
    weight = torch.randn(11, 6, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    h = hidden.clone().requires_grad_(trainable == "hidden")
    w = weight.clone().requires_grad_(trainable == "weight")
    logp, ent = logprobs_from_hidden(h, w, labels, chunk_size=4)
    (logp.sum() + ent.sum()).backward()
    rh, rw = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lsm = torch.log_softmax(rh @ rw.T, dim=-1)
    (lsm.gather(-1, labels[..., None]).sum() - (lsm.exp() * lsm).sum()).backward()
    got, want, other = (h.grad, rh.grad, w.grad) if trainable == "hidden" else (w.grad, rw.grad, h.grad)
    assert other is None
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
