"""Final-layer attention statistics for CompPO, streamed over key chunks (no [Tq, Tk] buffer).

Two read-outs of causal softmax attention ``a_{t,i} = softmax_i(s_{t,i})``, ``s = scale * <q_t, k_i>``:

- :func:`attention_concentration`: ``H[b, t] = mean_h sum_i a_{h,t,i}**2`` and ``n[b, t]`` visible keys,
  the inputs of the CompPO gate (``megatron_credit.credit.gates``). ``sum_i a_i**2 = exp(LSE(2 s) -
  2 LSE(s))``: one pass over key chunks keeps a running max ``m`` and ``l1 = sum exp(s - m)``,
  ``l2 = sum exp(2 (s - m))``, i.e. both log-sum-exps at once (``LSE(s) = m + log l1``,
  ``LSE(2 s) = 2 m + log l2``).
- :func:`attention_topk`: the ``k`` keys with the largest head-averaged weight ``mean_h a_{h,t,i}``
  (the transport-aligned critic pools over them). Exact: pass 1 gets each head's ``LSE(s)``, pass 2
  streams key chunks again, turns scores into weights ``exp(s - LSE)`` and merges a running top-k of
  unique int64 (weight, index) keys, so ties go to the smaller index deterministically.
- :func:`attention_statistics`: both for the final-layer capture, the same numbers bit for bit, with the
  top-k's pass 1 taken from the concentration's pass (their ``LSE(s)`` are one): two streams over the keys.

Attention sinks (``sink_keys = k > 0``, CompPO's ``algorithm.params.gate_sink_keys``): the first ``k``
positions (e.g. the BOS / system-prompt start that soaks up attention mass) are left out of ``H`` and
the distribution is renormalised over the remaining keys, ``a'_i = a_i / sum_{j >= k} a_j``, which is the
softmax of the scores of keys ``i >= k`` alone: the same streamed LSEs with those keys masked, and
``n`` counts the keys left. A query never loses its own key (it excludes ``j < min(k, t)``), so early
queries stay defined. The top-k read-out is unchanged (the critic pools over the real attention).

Shapes follow the attention kernels: ``query [B, Hq, Tq, D]``, ``key [B, Hkv, Tk, D]`` with ``Hq`` a
multiple of ``Hkv`` (GQA: query head ``h`` reads key head ``h // (Hq / Hkv)``, megatron's grouping).
Query ``t`` sits at global position ``q_positions[t]`` (default: the last ``Tq`` of ``Tk`` positions)
and sees key ``j`` iff ``j <= q_positions[t]``. Scores are float32 whatever the input dtype.

Memory: per (query chunk, key chunk) block one float32 score tile ``[B', Hq, c, c]`` (32 MB at B' = 1,
Hq = 8, c = 1024), worked on in place, and a few row vectors; nothing grows with ``Tq * Tk``. ``B'`` is
as many batch rows as fit in :data:`_TILE_BYTES` (one at least). When a query
chunk's keys fit in one chunk, the top-k reads the first pass's tile instead of computing it again. Measured
on CPU (``benchmarks/concentration.py``, tests/models/test_concentration.py): ~68 MB peak extra at every T from
2K to 20K (the tile plus the GEMM library's buffers), against 4 GB for a dense softmax at 8K. Query heads are grouped onto
their key head by a reshape (``[B, Hkv, G * c, D] @ [B, Hkv, D, c]``), so K is never repeated per head.
The causal structure is used: key chunks past a query chunk's last position are skipped.

Tensor parallelism (``tp_group``): each rank holds ``Hq / tp`` query heads and their key heads.
:func:`attention_concentration` sums its heads' ``H`` and all-reduces the sum (the mean over all heads);
:func:`attention_topk` needs every head's weight in the same row, so it all-gathers query and key heads
first (meant for the final layer only, where this is one layer's q/k) and every rank returns the same
exact result. Both run under ``torch.no_grad``: the statistics are detached by definition (CompPO's gate
is computed by the behaviour policy).

>>> q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4)   # equal scores: uniform attention
>>> h, n = attention_concentration(q, k)
>>> h, n
(tensor([[1.0000, 0.5000, 0.3333]]), tensor([[1, 2, 3]]))
>>> idx, w = attention_topk(q, k, 2)
>>> idx.tolist(), w
([[[0, 0], [0, 1], [0, 1]]], tensor([[[1.0000, 0.0000],
         [0.5000, 0.5000],
         [0.3333, 0.3333]]]))
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_credit.credit.gates import concentration_from_lse

__all__ = ["attention_concentration", "attention_statistics", "attention_topk"]


def _check(query: torch.Tensor, key: torch.Tensor, q_positions: Optional[torch.Tensor],
           chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes; return the query positions ``[Tq]`` (long) on the query's device and on the host. The
    loops size their key chunks from the host copy: positions given on the host (as the final-layer capture
    gives them) cost no device read; positions given on the device are read once here."""
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"query must be [B, Hq, Tq, D] and key [B, Hkv, Tk, D], got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    (b, hq, tq, d), (bk, hkv, tk, dk) = query.shape, key.shape
    if b != bk or d != dk:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in batch or head dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of key heads Hkv={hkv}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if q_positions is None:
        if tq > tk:
            raise ValueError(f"without q_positions the queries are the last Tq of Tk keys: Tq={tq} > Tk={tk}")
        host = torch.arange(tk - tq, tk)
        return host.to(query.device), host
    if q_positions.shape != (tq,):
        raise ValueError(f"q_positions must be [Tq] = [{tq}], got {tuple(q_positions.shape)}")
    host = q_positions.to(device="cpu", dtype=torch.long)
    if tq and (int(host.min()) < 0 or int(host.max()) >= tk):
        raise ValueError(f"q_positions must lie in [0, Tk={tk}), got [{int(host.min())}, {int(host.max())}]")
    return q_positions.to(device=query.device, dtype=torch.long), host


def _grouped_chunk(query: torch.Tensor, q0: int, q1: int, hkv: int, scale: float) -> torch.Tensor:
    """Query rows ``q0:q1`` as ``[B, Hkv, G * c, D]`` float32, pre-scaled (G query heads per key head)."""
    b, hq, _, d = query.shape
    q = query[:, :, q0:q1].float() * scale
    return q.reshape(b, hkv, (hq // hkv) * (q1 - q0), d)


_TILE_BYTES = 32 << 20
"""A block's score tile covers as many batch rows as fit in this many bytes (one row at least). A larger tile
costs more than it saves on the CPU: glibc serves a block over 32 MB by a fresh ``mmap``, page-faulted
again at every call, and it leaves the cache (measured: 16 rows of T = 1024, 8 heads, one tile per row took
0.40x the time of one 470 MB tile, the same results bit for bit)."""


def _blocks(query: torch.Tensor, key: torch.Tensor, chunk_size: int):
    """``(rows, q0, q1)`` blocks: a slice of batch rows whose tile ``[rows, Hq, c, c]`` float32 stays under
    :data:`_TILE_BYTES`, and a query chunk; rows in the outer loop."""
    b, hq, tq, _ = query.shape
    tile = hq * min(chunk_size, max(tq, 1)) * min(chunk_size, max(key.shape[2], 1)) * 4
    step = max(1, _TILE_BYTES // tile)
    for r0 in range(0, b, step):
        for q0 in range(0, tq, chunk_size):
            yield slice(r0, min(r0 + step, b)), q0, min(q0 + chunk_size, tq)


def _masked_scores(qg: torch.Tensor, key: torch.Tensor, k0: int, k1: int,
                   pos: torch.Tensor, sink_keys: int = 0) -> torch.Tensor:
    """Scores ``[B, Hkv, G, c, k1 - k0]`` float32 of grouped queries ``qg`` vs keys ``k0:k1``;
    ``-inf`` where key ``j > pos`` (``pos: [c]``, the chunk's query positions) and, with ``sink_keys``,
    where ``j < min(sink_keys, pos)`` (sinks left out; a query keeps its own key)."""
    b, hkv, gc, _ = qg.shape
    # The keys as a compact block: BLAS may pick another kernel (another rounding) for another memory
    # layout of the same values, and a packed stream's keys arrive permuted and gathered.
    s = torch.matmul(qg, key[:, :, k0:k1].float().contiguous().transpose(-1, -2))  # [B, Hkv, G*c, kc]
    s = s.view(b, hkv, gc // pos.numel(), pos.numel(), k1 - k0)
    cols = torch.arange(k0, k1, device=pos.device)[None, :]
    hidden = cols > pos[:, None]  # [c, kc]
    if sink_keys:
        hidden |= cols < pos.clamp(max=sink_keys)[:, None]
    return s.masked_fill_(hidden, float("-inf"))


_FLOOR = -40.0
"""Shifted scores ``s - m`` (``m`` the running row max) are clamped below at this before ``exp``: a key more
than 40 below its row's largest score, and a hidden key (score ``-inf``), counts as ``e**-40 ~ 4.2e-18`` of
the largest term instead of less. ``l1`` and ``l2`` hold that term (>= 1), so a row of ``T`` keys moves by
at most ``T * 4.2e-18`` relative: below float32's rounding (6e-8) for any ``T`` under 10**10. It keeps
``exp`` on its fast path: the CPU's vectorised ``exp`` takes a slow path for ``-inf`` and for results below
the smallest normal float, which made the causal half of every tile cost ~6x the rest (a square of such a
result is a denormal too). The top-k reads hidden keys as hidden (:func:`_sort_keys`), and visible keys at
the floor tie, going to the smaller index."""


def _online_lse(qg: torch.Tensor, key: torch.Tensor, pos: torch.Tensor, chunk: int, last: int, *,
                squares: bool, sink_keys: int = 0, keep: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per-head row max ``m``, ``LSE(s - m)`` and (if ``squares``) ``LSE(2 (s - m))``, each
    ``[B, Hkv, G, c]``, streamed over key chunks: ``LSE(s) = m + LSE(s - m)``. Keys from ``last`` on (one
    past the chunk's last query position, known on the host) are hidden from every query of the chunk.

    Running max ``m`` with ``l1 = sum exp(s - m)``, ``l2 = sum exp(2 (s - m))``; on a new max both sums
    are rescaled (by ``exp(m_old - m)`` and its square). Every query sees at least its own key, so
    ``l1 >= 1`` at the end; a row that has seen no key yet keeps ``m = -inf`` (``m_safe`` avoids
    ``-inf - -inf``). The shifted LSEs are returned because ``H = exp(LSE(2 s) - 2 LSE(s))`` does not
    change under ``s -> s - m``, and without ``m`` the float32 difference cancels nothing large.
    ``s - m`` is clamped at :data:`_FLOOR`; ``l2`` is summed as a squared norm (no tile of squares).

    ``keep``: when all keys fit one chunk, the fourth result is that chunk's ``exp(s - m)`` tile, exactly the
    tile :func:`_topk_pass` would compute again from the final ``m``; the top-k reads it instead (one matmul,
    mask and ``exp`` fewer). Otherwise None.
    """
    b, hkv, gc, _ = qg.shape
    shape = (b, hkv, gc // pos.numel(), pos.numel())
    m = torch.full(shape, float("-inf"), device=qg.device)
    l1, l2 = torch.zeros(shape, device=qg.device), torch.zeros(shape, device=qg.device)
    kept = None
    for k0 in range(0, last, chunk):
        k1 = min(k0 + chunk, last)
        s = _masked_scores(qg, key, k0, k1, pos, sink_keys)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)  # 0 where m was -inf
        e = s.sub_(m_safe[..., None]).clamp_(min=_FLOOR).exp_()  # in place: one score tile alive at a time
        l1 = l1 * alpha + e.sum(dim=-1)
        if squares:
            l2 = l2 * alpha * alpha + torch.linalg.vector_norm(e, dim=-1).square_()
        if keep and k0 == 0 and k1 == last:
            kept = e
        m = m_new
    return m, torch.log(l1), torch.log(l2) if squares else None, kept


def _scale(query: torch.Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


@torch.no_grad()
def attention_concentration(query: torch.Tensor, key: torch.Tensor, *, scale: Optional[float] = None,
                            chunk_size: int = 1024, tp_group=None, q_positions: Optional[torch.Tensor] = None,
                            sink_keys: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``H [B, Tq]`` float32 (mean over query heads of ``sum_i a_{t,i}**2``) and ``n [B, Tq]`` int64.

    ``query: [B, Hq, Tq, D]``, ``key: [B, Hkv, Tk, D]`` (any float dtype, after RoPE); ``scale`` defaults
    to ``1/sqrt(D)``; ``q_positions: [Tq]`` global query positions (default ``Tk - Tq + arange(Tq)``).
    With ``tp_group`` the heads are this rank's share and ``H`` is the mean over all ranks' heads
    (one all-reduce of ``[B, Tq]``; every rank of the group must call). ``chunk_size`` tiles both queries
    and keys. ``H`` lies in ``[1/n, 1]``. ``sink_keys``: leave out keys ``j < min(sink_keys, t)`` and
    renormalise over the rest (module docstring); ``n`` then counts the keys left.
    """
    pos, host = _check(query, key, q_positions, chunk_size)
    if sink_keys < 0:
        raise ValueError(f"sink_keys must be >= 0, got {sink_keys}")
    b, hq, tq, _ = query.shape
    hkv, scale = key.shape[1], _scale(query, scale)
    h_sum = torch.zeros(b, tq, device=query.device)
    for r, q0, q1 in _blocks(query, key, chunk_size):
        _, lse_s, lse_2s, _ = _online_lse(_grouped_chunk(query[r], q0, q1, hkv, scale), key[r], pos[q0:q1],
                                          chunk_size, int(host[q0:q1].max()) + 1, squares=True,
                                          sink_keys=sink_keys)  # max-shifted
        h_sum[r, q0:q1] = concentration_from_lse(lse_2s, lse_s).sum(dim=(1, 2))
    heads = hq
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(h_sum, group=tp_group)
        heads *= dist.get_world_size(tp_group)
    return h_sum / heads, (pos + 1 - pos.clamp(max=sink_keys)).expand(b, tq).clone()


def _gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``x [B, H_local, T, D]`` over ``group`` into ``[B, H_local * size, T, D]`` (rank order =
    megatron's TP head order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


_LOW32 = (1 << 32) - 1


def _sort_keys(weight: torch.Tensor, cols: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (weight desc, column asc): float32 bits of ``weight >= 0`` (monotone as
    integers for non-negative floats) in the high word, ``2**32 - 1 - col`` in the low word; ``-1``
    (below every key) where ``hidden``. Keys are unique, so ``torch.topk`` on them is exact and
    deterministic: ties in weight go to the smaller column, unlike ``torch.topk`` on the weights. Built in
    place in one int64 buffer."""
    keys = weight.view(torch.int32).to(torch.int64)
    keys <<= 32
    keys |= _LOW32 - cols
    return keys.masked_fill_(hidden, -1)


def _decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_sort_keys`: ``(weight float32, col int64)``; meaningless where ``keys < 0``
    (hidden: the caller pads those)."""
    weight = (keys >> 32).to(torch.int32).view(torch.float32)
    return weight, _LOW32 - (keys & _LOW32)


def _topk_pass(qg: torch.Tensor, key: torch.Tensor, p: torch.Tensor, m: torch.Tensor, log_l1: torch.Tensor,
               last: int, k: int, hq: int, chunk_size: int,
               kept: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2 of :func:`attention_topk` for one query chunk: ``(idx [B, c, k], weight [B, c, k])`` from the
    chunk's grouped queries ``qg``, positions ``p`` and pass 1's per-head ``m`` and ``log_l1 = LSE(s - m)``
    ``[B, Hkv, G, c]``: each head's weight is ``exp(s - m) * exp(-log_l1)``, with ``s - m`` clamped as in
    pass 1. ``kept``: pass 1's ``exp(s - m)`` tile of the only key chunk (:func:`_online_lse`), read instead
    of recomputed (its tile and a recomputed one are equal bit for bit: the same operations)."""
    best = None
    inv_l1 = torch.exp(-log_l1)[..., None]
    for k0 in range(0, last, chunk_size):  # weights, running top-k of (weight, -col) keys
        k1 = min(k0 + chunk_size, last)
        e = kept if kept is not None else _masked_scores(qg, key, k0, k1, p).sub_(m[..., None]).clamp_(
            min=_FLOOR).exp_()
        a = e.mul_(inv_l1).sum(dim=(1, 2)) / hq
        cols = torch.arange(k0, k1, device=p.device)
        keys = _sort_keys(a, cols, cols[None, :] > p[:, None])  # [B, c, kc]
        if best is not None:
            keys = torch.cat([best, keys], dim=-1)
        best = keys.topk(min(k, keys.shape[-1]), dim=-1).values  # sorted, descending
    if best.shape[-1] < k:  # fewer keys than k in all: pad below every key
        best = torch.cat([best, best.new_full((*best.shape[:-1], k - best.shape[-1]), -1)], dim=-1)
    w, i = _decode_keys(best)
    pad = best < 0  # fewer than k visible keys
    return torch.where(pad, p[None, :, None].expand_as(i), i), w.masked_fill(pad, 0.0)


@torch.no_grad()
def attention_topk(query: torch.Tensor, key: torch.Tensor, k: int, *, scale: Optional[float] = None,
                   chunk_size: int = 1024, tp_group=None,
                   q_positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx [B, Tq, k]`` int64 and ``weight [B, Tq, k]`` float32: the ``k`` largest ``mean_h a_{h,t,i}``.

    Same inputs as :func:`attention_concentration`; the mean runs over ALL query heads (with
    ``tp_group``, query and key heads are all-gathered first, so every rank returns the same result).
    Sorted by weight descending, ties by smaller index. Rows with fewer than ``k`` visible keys are
    padded with weight 0 and ``idx`` = the query's own position.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    pos, host = _check(query, key, q_positions, chunk_size)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        query, key = _gather_heads(query, tp_group), _gather_heads(key, tp_group)
    b, hq, tq, _ = query.shape
    hkv, scale = key.shape[1], _scale(query, scale)
    idx = torch.empty(b, tq, k, dtype=torch.long, device=query.device)
    weight = torch.empty(b, tq, k, device=query.device)
    for r, q0, q1 in _blocks(query, key, chunk_size):
        qg, kr, p = _grouped_chunk(query[r], q0, q1, hkv, scale), key[r], pos[q0:q1]
        last = int(host[q0:q1].max()) + 1  # keys from here on are hidden from every query of the chunk
        m, lse_shifted, _, kept = _online_lse(qg, kr, p, chunk_size, last, squares=False, keep=True)  # pass 1
        idx[r, q0:q1], weight[r, q0:q1] = _topk_pass(qg, kr, p, m, lse_shifted, last, k, hq, chunk_size, kept)
    return idx, weight


@torch.no_grad()
def attention_statistics(query: torch.Tensor, key: torch.Tensor, k: int, *, scale: Optional[float] = None,
                         chunk_size: int = 1024, tp_group=None, q_positions: Optional[torch.Tensor] = None,
                         sink_keys: int = 0) -> tuple[torch.Tensor, ...]:
    """``(H, n, idx, weight)``: :func:`attention_concentration` and :func:`attention_topk` of the same inputs,
    equal to the two calls bit for bit, for the final-layer capture, which wants both (``k = 0``: ``H, n``
    alone). Without sinks and tensor parallelism both read the same per-head ``LSE(s)`` (the same key chunks
    in the same order), so its first pass runs once for the two: two streams over the keys instead of
    three. With sinks (``H`` leaves keys out, the top-k does not) or with ``tp_group`` (``H`` sums this
    rank's heads, the top-k gathers all) it makes the two calls."""
    kw = dict(scale=scale, chunk_size=chunk_size, tp_group=tp_group, q_positions=q_positions)
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    if k < 1 or sink_keys or tp:
        h, n = attention_concentration(query, key, sink_keys=sink_keys, **kw)
        return (h, n) if k < 1 else (h, n, *attention_topk(query, key, k, **kw))
    pos, host = _check(query, key, q_positions, chunk_size)
    b, hq, tq, _ = query.shape
    hkv, scale = key.shape[1], _scale(query, scale)
    h_sum = torch.zeros(b, tq, device=query.device)
    idx = torch.empty(b, tq, k, dtype=torch.long, device=query.device)
    weight = torch.empty(b, tq, k, device=query.device)
    for r, q0, q1 in _blocks(query, key, chunk_size):
        qg, kr, p = _grouped_chunk(query[r], q0, q1, hkv, scale), key[r], pos[q0:q1]
        last = int(host[q0:q1].max()) + 1
        m, lse_s, lse_2s, kept = _online_lse(qg, kr, p, chunk_size, last, squares=True, keep=True)  # max-shifted
        h_sum[r, q0:q1] = concentration_from_lse(lse_2s, lse_s).sum(dim=(1, 2))
        idx[r, q0:q1], weight[r, q0:q1] = _topk_pass(qg, kr, p, m, lse_s, last, k, hq, chunk_size, kept)
    return h_sum / hq, (pos + 1).expand(b, tq).clone(), idx, weight
