"""reverse_linear_scan against a slow loop reference, and CP = 2, 4 on gloo against CP = 1."""
import pytest
import torch

from megatron_credit.credit.scan import reverse_linear_scan
from tests.references import scan_reference
from tests.support.distributed_harness import block_subgroup, load_balanced_shard
from tests.support.threaded_harness import gloo_and_threads_pool


def random_case(b, t, seed, dtype=torch.float64, zero_frac=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=dtype)
    a = torch.rand(b, t, generator=g, dtype=dtype) * 1.05  # some coefficients > 1: growth is allowed
    a[torch.rand(b, t, generator=g) < zero_frac] = 0.0     # cuts (packed sequence boundaries)
    return x, a


@pytest.mark.parametrize("t", [0, 1, 2, 3, 7, 64, 127, 128, 129, 515, 2000])
@pytest.mark.parametrize("k", [2, 8, 128])
def test_general_matches_loop_float64(t, k):
    x, a = random_case(3, t, seed=t * 131 + k)
    y = reverse_linear_scan(x, a, chunk_size=k)
    assert y.shape == x.shape and y.dtype == torch.float64
    torch.testing.assert_close(y, scan_reference(x, a), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [0, 1, 5, 128, 300, 4100])
@pytest.mark.parametrize("k", [4, 128])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2 ** (-1 / 32), 1.0])
def test_constant_coefficient_matches_loop(t, k, gamma):
    x, _ = random_case(2, t, seed=t + k)
    torch.testing.assert_close(reverse_linear_scan(x, gamma, chunk_size=k), scan_reference(x, gamma),
                               rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("k", [64, 128])
def test_constant_path_at_large_chunk_matches_loop(k):
    # On CPU the public call caps the constant path's K at 32; the K used on CUDA is tested directly.
    from megatron_credit.credit import scan

    assert scan.constant_chunk_size(k, torch.device("cpu")) == 32
    assert scan.constant_chunk_size(k, torch.device("cuda")) == k
    for t in (1, 100, 4100):
        x, _ = random_case(3, t, seed=t + k)
        for gamma in (0.0, 2 ** (-1 / 32), 1.0):
            torch.testing.assert_close(scan._scan_constant(x, gamma, k), scan_reference(x, gamma),
                                       rtol=1e-12, atol=1e-12)


def test_float32_close_to_float64():
    x, a = random_case(4, 3000, seed=5, dtype=torch.float64)
    a = a.clamp(max=0.999)
    ref = scan_reference(x, a)
    y32 = reverse_linear_scan(x.float(), a.float())
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reverse_linear_scan(x.float(), 0.98).double(), scan_reference(x, 0.98),
                               rtol=1e-4, atol=1e-4)


def test_zero_coefficients_cut_packed_sequences():
    # Two packed sequences in one row: the cut at index 2 makes them independent.
    x = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0]], dtype=torch.float64)
    a = torch.tensor([[0.5, 0.5, 0.0, 0.5, 0.0]], dtype=torch.float64)
    y = reverse_linear_scan(x, a, chunk_size=2)
    torch.testing.assert_close(y, torch.tensor([[1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0, 20.0, 20.0]],
                                               dtype=torch.float64))
    # Changing the second sequence never changes the first.
    x2 = x.clone()
    x2[0, 3:] = 1e6
    torch.testing.assert_close(reverse_linear_scan(x2, a, chunk_size=2)[0, :3], y[0, :3])


def test_no_overflow_on_long_sequences():
    # gamma**(-t) tricks would give 2**(20480/32) = inf; products of coefficients only underflow.
    x = torch.zeros(1, 20480)
    x[0, -1] = 1.0
    y = reverse_linear_scan(x, 2 ** (-1 / 32))
    assert torch.isfinite(y).all() and y[0, -1] == 1.0 and y[0, 0] == 0.0
    y = reverse_linear_scan(x, torch.full_like(x, 2 ** (-1 / 32)))
    assert torch.isfinite(y).all() and y[0, -1] == 1.0


def test_gradients_flow_through_local_scan():
    x, a = random_case(2, 40, seed=3)
    x.requires_grad_(True)
    w = torch.randn(2, 40, dtype=torch.float64)
    (reverse_linear_scan(x, a, chunk_size=8) * w).sum().backward()
    # dL/dx_u = sum_t w_t W[t, u] = the forward scan of w with the coefficients shifted by one.
    a_prev = torch.nn.functional.pad(a[:, :-1], (1, 0))
    g_ref = scan_reference(w.flip(1), a_prev.flip(1)).flip(1)
    torch.testing.assert_close(x.grad, g_ref, rtol=1e-12, atol=1e-12)


def test_gradients_flow_through_constant_scan():
    x = torch.randn(2, 300, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 300, dtype=torch.float64)
    (reverse_linear_scan(x, 0.9, chunk_size=16) * w).sum().backward()
    g_ref = scan_reference(w.flip(1), 0.9).flip(1)  # the transpose of a constant scan is a forward scan
    torch.testing.assert_close(x.grad, g_ref, rtol=1e-12, atol=1e-12)


def test_tables_first_built_under_inference_mode_serve_differentiable_calls():
    from megatron_credit.credit import scan

    scan._constant_tables.cache_clear()
    gamma = 0.123456789  # a value no other test uses
    x = torch.randn(2, 40, dtype=torch.float64)
    with torch.inference_mode():
        y_inf = reverse_linear_scan(x, gamma, chunk_size=8)
    xg = x.clone().requires_grad_(True)
    y = reverse_linear_scan(xg, gamma, chunk_size=8)  # reuses the cached tables, saved for backward
    y.sum().backward()
    torch.testing.assert_close(y.detach(), y_inf, rtol=0, atol=0)
    torch.testing.assert_close(y.detach(), scan_reference(x, gamma), rtol=1e-12, atol=1e-12)
    # d(sum_t y_t)/dx_u = sum_{t<=u} gamma**(u-t)
    ref_grad = torch.tensor([sum(gamma ** (u - t) for t in range(u + 1)) for u in range(40)], dtype=torch.float64)
    torch.testing.assert_close(xg.grad, ref_grad.expand(2, 40), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_cuda_float32_constant_scan_is_not_tf32():
    # TF32 in the constant-decay matmul would give ~1e-3 absolute error at T = 20480; the CUDA path does
    # that matmul in float64, so float32 inputs match the float64 result to float32 rounding.
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the setting that would hurt
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 20480, generator=g, dtype=torch.float64) * 0.3
        gamma = 2 ** (-1 / 32)
        ref = reverse_linear_scan(x, gamma)  # CPU float64
        for k in (32, 128):
            got = reverse_linear_scan(x.float().cuda(), gamma, chunk_size=k).cpu().double()
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=5e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="x must be"):
        reverse_linear_scan(torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="coef shape"):
        reverse_linear_scan(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"^chunk_size must be >= 2, got 1$"):
        reverse_linear_scan(torch.zeros(2, 3), 0.5, chunk_size=1)


@pytest.fixture(autouse=True)
def _fresh_constant_tables():
    """Every test builds the constant path's tables itself (they are cached per gamma, K, dtype, device):
    no test passes on tables an earlier test built, and mutmut's forked runs, which inherit the cache of
    the process that ran the tests before, rebuild them with the mutated code."""
    from megatron_credit.credit.scan import _constant_tables

    _constant_tables.cache_clear()
    yield


@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_float64_matmul_path_rounds_once(t):
    # The constant path's float64 in-chunk matmul (what CUDA float32 inputs take, against TF32) tested on
    # the CPU: float32 in, float32 out, within a rounding or two of the float64 scan; and the CPU's default
    # for float32 is the float32 matmul (bit for bit the explicit choice).
    from megatron_credit.credit.scan import _scan_constant

    x64 = torch.randn(3, t, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
    x32 = x64.float()
    exact = scan_reference(x32.double(), 0.97)
    for k in (2, 8, 32):
        y = _scan_constant(x32, 0.97, k, float64_matmul=True)
        assert y.dtype == torch.float32 and y.shape == x32.shape
        torch.testing.assert_close(y.double(), exact, rtol=2e-6, atol=1e-6)
        assert torch.equal(_scan_constant(x32, 0.97, k), _scan_constant(x32, 0.97, k, float64_matmul=False))
    assert torch.equal(_scan_constant(x64, 0.97, 8, float64_matmul=True), _scan_constant(x64, 0.97, 8))
    if t <= 32:  # one chunk: the float64 matmul rounded once is the exact scan rounded once
        assert torch.equal(_scan_constant(x32, 0.97, 32, float64_matmul=True), exact.float())


def test_empty_rows_scan_to_empty_rows():
    for coef in (0.5, torch.zeros(2, 0)):
        y = reverse_linear_scan(torch.zeros(2, 0), coef)
        assert y.shape == (2, 0)


# ---------------------------------------------------------------------------- context parallel (gloo)

cp_shard = load_balanced_shard


def _cp_scan_worker(cases):
    import torch.distributed as dist

    groups = {1: None, **{cp: block_subgroup(cp)[0] for cp in (2, 4)}}
    out = []
    for x, a, k in cases:
        for cp in (2, 4):
            r = dist.get_rank(groups[cp])
            for coef in (a, 0.9, 2 ** (-1 / 32)):
                c = cp_shard(coef, cp, r) if isinstance(coef, torch.Tensor) else coef
                y = reverse_linear_scan(cp_shard(x, cp, r), c, chunk_size=k, cp_group=groups[cp])
                out.append((cp, r, y))
    return out


pool = gloo_and_threads_pool(4)  # [gloo] spawned workers, [threads] ranks as threads (traced by mutmut)


def test_cp_2_and_4_equal_unsharded(pool):
    cases = []
    for seed, (t, k) in enumerate([(8, 2), (64, 4), (400, 16), (1024, 128), (24, 128)]):
        x, a = random_case(3, t, seed=seed)
        cases.append((x, a, k))
    results = pool.run(_cp_scan_worker, cases)
    checked = 0
    for rank_results in results:
        it = iter(rank_results)
        for x, a, k in cases:
            for cp in (2, 4):
                for coef in (a, 0.9, 2 ** (-1 / 32)):
                    got_cp, r, y = next(it)
                    assert got_cp == cp
                    expect = cp_shard(reverse_linear_scan(x, coef, chunk_size=k), cp, r)
                    torch.testing.assert_close(y, expect, rtol=1e-12, atol=1e-12)
                    torch.testing.assert_close(y, cp_shard(scan_reference(x, coef), cp, r),
                                               rtol=1e-11, atol=1e-11)
                    checked += 1
    assert checked == 4 * len(cases) * 2 * 3


def _cp_edge_worker():
    group, _ = block_subgroup(2)
    try:
        reverse_linear_scan(torch.zeros(2, 3), 0.5, cp_group=group)
        message = None
    except ValueError as e:
        message = str(e)
    shapes = [tuple(reverse_linear_scan(torch.zeros(2, 0), coef, cp_group=group).shape)
              for coef in (0.5, torch.zeros(2, 0))]
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6) / 7  # this rank's float32 shard
    dtypes = [reverse_linear_scan(x, coef, chunk_size=2, cp_group=group).dtype
              for coef in (0.9, torch.full((2, 6), 0.9))]
    return message, shapes, dtypes


def test_cp_refuses_odd_shards_and_scans_empty_ones(pool):
    for message, shapes, dtypes in pool.run(_cp_edge_worker):
        assert message == "with cp_group the local length must hold two equal chunks, got T=3"
        assert shapes == [(2, 0), (2, 0)]
        assert dtypes == [torch.float32, torch.float32]  # the carries' fix-up keeps the input's dtype
