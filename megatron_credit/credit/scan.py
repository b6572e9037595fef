"""The transport operator: one reverse linear recurrence for every credit estimator.

    y[:, t] = x[:, t] + coef[:, t] * y[:, t + 1],      y[:, T] = 0

GAE, Comp-GAE and FIPO's Future-KL are all this recurrence with different evidence ``x`` and transport
``coef`` (docs/architecture.md, "One idea at the centre"). A zero coefficient cuts the recurrence, which is how
packed sequences are kept apart.

Algorithm (exact, no division, no ``gamma**(-t)``):

1. Pad T to a multiple of the chunk size K (``x = 0``, ``coef = 1`` in the padding, so the padding adds
   nothing and does not change suffix products) and view the row as ``[B, n, K]`` chunks.
2. In each chunk, compute the zero-carry result ``y_loc`` and the suffix product
   ``p[t] = prod_{j=t}^{end} coef_j`` (what a carry entering from the right is multiplied by).
   *General coefficients:* the K x K transfer matrix ``W[t, u] = prod_{j=t}^{u-1} coef_j`` is applied in
   factored form by log2(K) doubling steps (each step composes pairs ``(p, y)``), which is O(B*T*log K)
   time and O(B*T) memory instead of materialising ``[B, n, K, K]`` (O(B*T*K) memory). This departs from
   docs/architecture.md's "one small matmul per chunk" only in how W is applied; the result is the same sum.
   *Constant coefficient* (``coef`` a Python float, e.g. FIPO's ``2**(-1/tau)``): W is the same Toeplitz
   matrix ``gamma**(u-t)`` in every chunk, so one ``[B*n, K] @ [K, K]`` matmul does all chunks. Its cost
   is O(B*T*K) flops: on CPU K = 32 is about 2x faster than 128 (benchmarks/credit_kernels.py), so on
   CPU this path caps K at ``CPU_CONSTANT_CHUNK = 32`` whatever ``chunk_size`` says; on GPU the matmul is
   nearly free, ``chunk_size`` is used as given, and a larger K means fewer recursion levels. On CUDA the matmul of
   float32 inputs is done in float64 (TF32 would cost ~1e-3 absolute error at T = 20480).
3. The chunk-start values and chunk products form a recurrence of the same kind over the n chunks; it is
   solved by the same function recursively (depth log_K(T)), then ``y += p * carry`` fixes each chunk.

Context parallel (``cp_group``): the tensors are this rank's share in megatron's load-balanced chunk order
(rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks, concatenated). Each half is scanned with zero
carry-in; every rank all-gathers ``(y at the half's start, product of the half's coefficients)``, i.e.
4*B scalars, reconstructs the exact carry entering each of its halves, and applies ``y += p * carry``.
Communication is O(B*cp). Gradients do not flow through the CP carry (all callers use detached credit).

>>> import torch
>>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
>>> reverse_linear_scan(x, torch.tensor([[0.5, 0.0, 1.0, 1.0]]), chunk_size=2)
tensor([[2., 2., 7., 4.]])
>>> reverse_linear_scan(x, 1.0, chunk_size=2)  # a float coefficient: the Toeplitz fast path
tensor([[10.,  9.,  7.,  4.]])
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Union

import torch

from megatron_credit.batch.cp_chunks import chunk_owner, rank_chunks

Coef = Union[torch.Tensor, float]


def reverse_linear_scan(x: torch.Tensor, coef: Coef, *, chunk_size: int = 128,
                        cp_group: Any = None) -> torch.Tensor:
    """Solve ``y_t = x_t + coef_t * y_{t+1}`` (``y_T = 0``) along the last dimension.

    Args:
        x: evidence ``[B, T]`` (float32 or float64).
        coef: transport ``[B, T]`` of the same dtype, or a Python float used at every position (the
            constant-decay fast path). ``coef[:, t] == 0`` cuts the recurrence after t. ``x`` and ``coef``
            must be finite everywhere, padding included: a NaN anywhere in a chunk reaches the whole
            chunk through products with 0 (``0 * NaN = NaN``); callers select padding away first.
        chunk_size: K; time O(B*T*K) at worst, extra memory O(B*T + K**2). For a float ``coef`` on CPU
            K is capped at ``CPU_CONSTANT_CHUNK`` (see :func:`constant_chunk_size`); the result is the
            same sum either way.
        cp_group: a ``torch.distributed`` process group; if given, ``x`` and ``coef`` hold this rank's
            share in megatron's load-balanced context-parallel chunk order, and so does the result.

    Returns:
        ``y``: ``[B, T]``, same dtype as ``x``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [B, T], got shape {tuple(x.shape)}")
    if isinstance(coef, torch.Tensor) and coef.shape != x.shape:
        raise ValueError(f"coef shape {tuple(coef.shape)} != x shape {tuple(x.shape)}")
    if chunk_size < 2:
        raise ValueError(f"chunk_size must be >= 2, got {chunk_size}")
    if cp_group is None:
        return _scan(x, coef, chunk_size)[0]
    return _cp_scan(x, coef, chunk_size, cp_group)


def _scan(x: torch.Tensor, coef: Coef, k: int, *, need_p: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero-carry scan of ``[B, T]`` rows; returns ``(y, p)`` with ``p[:, t] = prod_{j>=t} coef_j``.

    ``p`` is only formed when asked for (CP); for a float coefficient it is ``gamma**(T - t)``, with
    non-negative exponents only, so it underflows to 0 but never overflows.
    """
    if isinstance(coef, torch.Tensor):
        return _scan_general(x, coef, k)
    y = _scan_constant(x, float(coef), constant_chunk_size(k, x.device))
    if not need_p:
        return y, None
    t = x.shape[-1]
    p = torch.pow(torch.tensor(float(coef), dtype=torch.float64, device=x.device),
                  torch.arange(t, 0, -1, dtype=torch.float64, device=x.device)).to(x.dtype)
    return y, p.expand_as(x)


CPU_CONSTANT_CHUNK = 32
"""Largest K of the constant-coefficient path on CPU. Its in-chunk work is a ``[*, K] @ [K, K]`` matmul,
O(B*T*K) flops; on one CPU thread at B = 8, T = 20480 (benchmarks/credit_kernels.py) K = 32 runs at
~2.4x the cumsum floor and K = 128 at ~4.3x (K = 16 is no faster: more recursion). On CUDA the matmul
is nearly free and ``chunk_size`` is used as given."""


def constant_chunk_size(chunk_size: int, device: torch.device) -> int:
    """The K the constant-coefficient path uses: ``chunk_size``, capped at ``CPU_CONSTANT_CHUNK`` on CPU.

    >>> constant_chunk_size(128, torch.device("cpu")), constant_chunk_size(8, torch.device("cpu"))
    (32, 8)
    """
    return chunk_size if device.type == "cuda" else min(chunk_size, CPU_CONSTANT_CHUNK)


def _scan_general(x: torch.Tensor, a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = x.shape
    if t <= 1:
        return x.clone(), a.clone()
    k = min(k, _next_pow2(t))
    n = -(-t // k)
    pad = n * k - t
    xc = torch.nn.functional.pad(x, (0, pad), value=0.0).view(b, n, k)
    ac = torch.nn.functional.pad(a, (0, pad), value=1.0).view(b, n, k)
    y, p = _doubling(xc, ac)
    if n > 1:
        # Chunk j starts with y[:, j, 0] and passes a carry through with product p[:, j, 0]; the same
        # recurrence over chunks gives the exact value and product at every chunk start.
        ys, ps = _scan_general(y[:, :, 0], p[:, :, 0], k)
        zero = ys.new_zeros(b, 1)
        carry = torch.cat([ys[:, 1:], zero], dim=1)                  # y entering chunk j from the right
        carry_p = torch.cat([ps[:, 1:], torch.ones_like(zero)], dim=1)  # product from chunk j+1 to end
        y = y + p * carry[:, :, None]
        p = p * carry_p[:, :, None]
    return y.reshape(b, n * k)[:, :t], p.reshape(b, n * k)[:, :t]


def _doubling(y: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-chunk scan of ``[..., K]`` by log2(K) doubling steps (the K x K transfer W in factored form).

    Invariant before the step with shift s: ``y[t] = sum_{u=t}^{t+s-1} W[t, u] x[u]`` and
    ``p[t] = prod_{j=t}^{t+s-1} a_j`` (both truncated at the chunk end). Composing with position t+s
    doubles the span. Only products of coefficients are formed, so zeros are safe.
    """
    k = y.shape[-1]
    s = 1
    while s < k:
        y = torch.cat([torch.addcmul(y[..., :-s], p[..., :-s], y[..., s:]), y[..., -s:]], dim=-1)
        p = torch.cat([p[..., :-s] * p[..., s:], p[..., -s:]], dim=-1)
        s *= 2
    return y, p


def _scan_constant(x: torch.Tensor, gamma: float, k: int, *, float64_matmul: Optional[bool] = None) -> torch.Tensor:
    """Zero-carry scan with one coefficient ``gamma`` everywhere: a shared Toeplitz block per chunk.

    ``float64_matmul`` (default: on CUDA for inputs below float64): the in-chunk matmul in float64,
    rounded once to ``x``'s dtype. CUDA float32 matmuls may run in TF32 (10-bit mantissa): ~1e-3 absolute
    error in F at T = 20480; the matmul is only B*T*K flops, so it is done in float64 on the GPU. On the
    CPU the float32 matmul is exact enough and faster; the float64 path is testable there too."""
    b, t = x.shape
    if t == 0:
        return x.clone()
    if float64_matmul is None:
        float64_matmul = x.is_cuda and x.dtype != torch.float64
    k = min(k, _next_pow2(t))
    n = -(-t // k)
    xc = (x if n * k == t else torch.nn.functional.pad(x, (0, n * k - t))).reshape(b * n, k)
    if float64_matmul:
        toeplitz, _ = _constant_tables(gamma, k, torch.float64, x.device)
        _, tail = _constant_tables(gamma, k, x.dtype, x.device)
        y = (xc.double() @ toeplitz).to(x.dtype).view(b, n, k)
    else:
        toeplitz, tail = _constant_tables(gamma, k, x.dtype, x.device)
        y = (xc @ toeplitz).view(b, n, k)
    if n > 1:
        # The chunk starts obey the same recurrence with coefficient gamma**K (underflow to 0 is fine).
        ys = _scan_constant(y[:, :, 0], gamma ** k, k, float64_matmul=float64_matmul)
        carry = torch.cat([ys[:, 1:], ys.new_zeros(b, 1)], dim=1)
        # In place on the matmul output (its backward does not need it): y_i += gamma**(K - i) carry.
        y.addcmul_(carry[:, :, None], tail)
    return y.view(b, n * k)[:, :t]


@functools.lru_cache(maxsize=64)
def _constant_tables(gamma: float, k: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_T[u, t] = gamma**(u - t)`` (``u >= t``, else 0), ``[K, K]``, so that ``y = x @ W_T``; and
    ``tail[i] = gamma**(K - i)``, ``[K]``. Powers are formed in float64 with non-negative exponents.
    Cached: a pure function of its arguments, called once per recursion level; never mutated. Built
    outside inference mode and autograd, so a table first made under ``torch.inference_mode`` is a
    normal tensor and can be saved for backward by later differentiable calls.
    """
    with torch.inference_mode(False), torch.no_grad():
        return _build_constant_tables(gamma, k, dtype, device)


def _build_constant_tables(gamma: float, k: int, dtype: torch.dtype,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    powers = torch.pow(torch.tensor(gamma, dtype=torch.float64),
                       torch.arange(k + 1, dtype=torch.float64))            # gamma**0 .. gamma**K
    idx = torch.arange(k)
    diff = idx[:, None] - idx[None, :]
    toeplitz = torch.where(diff >= 0, powers[diff.clamp(min=0)], torch.zeros((), dtype=torch.float64))
    return toeplitz.to(dtype=dtype, device=device), powers[1:].flip(0).to(dtype=dtype, device=device)


def _next_pow2(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


def _cp_scan(x: torch.Tensor, coef: Coef, k: int, group: Any) -> torch.Tensor:
    """Scan of this rank's two load-balanced CP chunks; exact carries from an O(B*cp) all-gather."""
    import torch.distributed as dist

    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    b, t = x.shape
    if t % 2:
        raise ValueError(f"with cp_group the local length must hold two equal chunks, got T={t}")
    h = t // 2
    halves = []
    for sl in (slice(0, h), slice(h, t)):
        c = coef[:, sl] if isinstance(coef, torch.Tensor) else coef
        halves.append(_scan(x[:, sl], c, k, need_p=True))
    (ya, pa), (yb, pb) = halves

    def summary(y: torch.Tensor, p: torch.Tensor) -> list[torch.Tensor]:  # [B] start value, product
        return [y[:, 0], p[:, 0]] if h else [x.new_zeros(b), x.new_ones(b)]

    summary_all = torch.stack(summary(ya, pa) + summary(yb, pb), dim=1).contiguous()  # [B, 4]
    gathered = [torch.empty_like(summary_all) for _ in range(cp)]
    dist.all_gather(gathered, summary_all, group=group)
    owner = [chunk_owner(j, cp_size=cp) for j in range(2 * cp)]  # (rank, half) holding global chunk j
    start = [gathered[r][:, 2 * half] for r, half in owner]
    prod = [gathered[r][:, 2 * half + 1] for r, half in owner]
    carry = [x.new_zeros(b)] * (2 * cp)  # carry[j]: y at the first token after chunk j
    for j in range(2 * cp - 2, -1, -1):
        carry[j] = start[j + 1] + prod[j + 1] * carry[j + 1]
    first, second = rank_chunks(cp_rank=rank, cp_size=cp)
    ya = torch.addcmul(ya, pa, carry[first][:, None])
    yb = torch.addcmul(yb, pb, carry[second][:, None])
    return torch.cat([ya, yb], dim=1)
