"""Per-token log-probabilities and entropies over a tensor-parallel (vocab-sharded) vocabulary.

Megatron's output layer is column-parallel: rank ``r`` of the TP group holds the logits of vocabulary
ids ``[r * V_local, (r + 1) * V_local)``. For every token we need, over the *global* vocabulary,

    z     = logits / temperature                      (scaled logits, one row of V = tp * V_local)
    lse   = log sum_j exp(z_j)                        (= m + log sum_j exp(z_j - m), m = max_j z_j)
    logp  = z_y - lse                                 (y = the label)
    H     = -sum_j p_j log p_j = lse - sum_j p_j z_j  (p = softmax(z))
          = log S - E_p[z - m]                        (S = sum_j exp(z_j - m); no cancellation at large |z|)

Each needs only four per-token reductions over the vocabulary, which are all-reduced across TP:
``max_j z_j`` (MAX), then ``S``, ``z_y`` (one rank holds it, the others add 0) and
``sum_j exp(z_j - m) (z_j - m)`` (SUM, one collective for the three).

Gradients, with ``g`` and ``h`` the incoming gradients of ``logp`` and ``H`` (``d p_i / d z_j =
p_i (delta_ij - p_j)``)::

    d logp / d z_j = delta_{j,y} - p_j
    d H / d z_j    = p_j - [p_j + p_j z_j - p_j sum_i p_i z_i] = -p_j (z_j - E_p[z])
    d L / d z_j    = g delta_{j,y} - p_j (g + h (z_j - E_p[z]))
    d L / d logits = (d L / d z) / temperature

``lse`` and ``E_p[z]`` are global per-token scalars saved by the forward, so ``p_j = exp(z_j - lse)`` is
recomputed locally in the backward and the logits gradient needs no communication.

Memory: the sequence is processed in chunks of ``chunk_size`` tokens; only one chunk is ever upcast to
fp32 (two chunk-sized fp32 buffers live at a time), so no ``[B, T, V]`` fp32 tensor exists. The logits are
never modified (megatron's ``vocab_parallel_cross_entropy`` subtracts the max in place, which corrupts
logits still needed for the entropy). ``logprobs_from_hidden`` goes further and computes each chunk's
logits from the final hidden state, so not even the ``[B, T, V_local]`` logits in bf16 exist.

Temperature: the rollout engine samples from ``softmax(logits / temperature)``; the log-probs of the
training engine must be those of the same distribution, so the division happens here (in fp32, after
upcasting) rather than being left to the caller.

Labels must be valid global ids in ``[0, tp * V_local)`` (use any valid id, e.g. the pad id, at positions
the loss masks out): a label outside every shard silently gives ``z_y = 0`` (checking would need a host
sync). Padded vocabulary rows (megatron pads V to a multiple of 128 * tp) take part in the softmax, as in
megatron's own cross-entropy.

>>> logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]])
>>> logp, ent = logprobs_and_entropy(logits, torch.tensor([[2, 0]]), chunk_size=1)
>>> torch.allclose(logp, torch.log_softmax(logits, -1)[0, [0, 1], [2, 0]].unsqueeze(0))
True
>>> round(ent[0, 1].item(), 4) == round(float(torch.log(torch.tensor(3.0))), 4)
True
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["logprobs_and_entropy", "logprobs_from_hidden"]

ProcessGroup = Optional["dist.ProcessGroup"]


# --------------------------------------------------------------------------------------------- helpers
def _tp_rank_and_size(group: ProcessGroup) -> tuple[int, int]:
    """``None`` means no tensor parallelism (never the default WORLD group: groups are explicit)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _all_reduce(t: torch.Tensor, op, group: ProcessGroup) -> torch.Tensor:
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and lower precisions; float64 stays float64 (so tests can use exact tolerances)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x: [B, T, D]`` as ``[B*T, D]`` without a copy, or None when the strides do not allow it."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _rows(x: torch.Tensor, flat: Optional[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Token rows ``[start, stop)`` of ``x: [B, T, D]`` flattened to ``[stop - start, D]``.

    A view when ``flat`` exists; otherwise only this chunk is copied (never the whole tensor).
    """
    if flat is not None:
        return flat[start:stop]
    seq = x.shape[1]
    pieces = []
    for b in range(start // seq, (stop - 1) // seq + 1):
        lo, hi = max(start - b * seq, 0), min(stop - b * seq, seq)
        pieces.append(x[b, lo:hi])
    return torch.cat(pieces, dim=0)


def _local_labels(labels: torch.Tensor, vocab_start: int, vocab_local: int):
    """Labels ``[n]`` -> (index into this shard, clamped to be safe ``[n]``; 1.0 where the shard owns it)."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), owned


def _forward_chunk(z, index, owned, group, compute_entropy):
    """Global statistics of one chunk of scaled logits ``z: [n, V_local]`` (a fresh buffer; consumed).

    Returns ``logp, lse, mean_z, ent: [n]`` (``mean_z = E_p[z]`` and ``ent = H``, None without entropy).
    The entropy is ``log S - E_p[z - m]`` with ``S = sum_j exp(z_j - m)``: both terms are O(log V), so
    it keeps fp32 precision when the logits are large (``lse - E_p[z]`` would cancel two ~|z| numbers).
    """
    m = z.max(dim=-1).values
    _all_reduce(m, dist.ReduceOp.MAX, group)
    z_y = z.gather(1, index.unsqueeze(1)).squeeze(1) * owned
    zm = z.sub_(m.unsqueeze(1))  # z - m, in place: z is not needed afterwards
    e = zm.exp()
    sums = [e.sum(dim=-1), z_y]
    if compute_entropy:
        sums.append(e.mul_(zm).sum(dim=-1))  # sum_j exp(z_j - m) (z_j - m)
    sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
    log_s = sums[0].log()
    lse = m + log_s
    if not compute_entropy:
        return sums[1] - lse, lse, None, None
    mean_zm = sums[2] / sums[0]  # E_p[z - m]
    return sums[1] - lse, lse, m + mean_zm, log_s - mean_zm


def _grad_chunk(z, index, owned, lse, mean_z, g_logp, g_ent):
    """``dL/dz: [n, V_local]`` of one chunk, written into ``z`` (a fresh buffer; consumed).

    ``dL/dz_j = g delta_{j,y} - p_j (g + h (z_j - E_p[z]))`` with ``g = g_logp``, ``h = g_ent``.
    """
    p = (z - lse.unsqueeze(1)).exp_()
    if g_ent is not None:
        coef = z.sub_(mean_z.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
        if g_logp is not None:
            coef.add_(g_logp.unsqueeze(1))
    else:
        coef = z.copy_(g_logp.unsqueeze(1).expand_as(z))
    grad = coef.mul_(p).neg_()
    if g_logp is not None:
        grad.scatter_add_(1, index.unsqueeze(1), (g_logp * owned).unsqueeze(1))
    return grad


def _chunk_bounds(n_tokens: int, chunk_size: int):
    return [(s, min(s + chunk_size, n_tokens)) for s in range(0, n_tokens, chunk_size)]


def _check_args(name: str, x: torch.Tensor, labels: torch.Tensor, chunk_size: int, temperature: float):
    if x.dim() != 3:
        raise ValueError(f"{name} must be [B, T, D], got shape {tuple(x.shape)}")
    if tuple(labels.shape) != tuple(x.shape[:2]):
        raise ValueError(f"labels must be [B, T] = {tuple(x.shape[:2])}, got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _label_index(labels, group, vocab_local, cdtype):
    """Flattened labels -> (index into this rank's shard, 1.0 where it owns the label): ``[B*T]`` each."""
    rank, _ = _tp_rank_and_size(group)
    index, owned = _local_labels(labels.reshape(-1).long(), rank * vocab_local, vocab_local)
    return index, owned.to(cdtype)


def _chunked_forward(n, chunk_logits, index, owned, group, compute_entropy, cdtype, device):
    """Run ``_forward_chunk`` over ``n`` tokens in chunks; ``chunk_logits(s, e)`` gives a fresh scaled
    fp32 ``[e - s, V_local]`` buffer. Returns ``logp, lse, mean_z, ent: [n]`` (the last two None
    without entropy)."""
    logp = torch.empty(n, dtype=cdtype, device=device)
    lse = torch.empty_like(logp)
    mean_z = torch.empty_like(logp) if compute_entropy else None
    ent = torch.empty_like(logp) if compute_entropy else None
    for s, e in _chunk_bounds(n, chunk_logits.chunk_size):
        lp, ls, mz, h = _forward_chunk(chunk_logits(s, e), index[s:e], owned[s:e], group, compute_entropy)
        logp[s:e], lse[s:e] = lp, ls
        if compute_entropy:
            mean_z[s:e], ent[s:e] = mz, h
    return logp, lse, mean_z, ent


def _chunk_grad(z, s, e, index, owned, lse, mean_z, g_logp, g_ent, temperature):
    """``dL/d(unscaled logits)`` of token rows ``[s, e)`` from their scaled logits ``z`` (consumed)."""
    gz = _grad_chunk(z, index[s:e], owned[s:e], lse[s:e],
                     None if mean_z is None else mean_z[s:e],
                     None if g_logp is None else g_logp[s:e],
                     None if g_ent is None else g_ent[s:e])
    if temperature != 1.0:
        gz.div_(temperature)
    return gz


class _ChunkLogits:
    """``(s, e) -> scaled fp32 logits of token rows [s, e)``, a fresh buffer, from logits or hidden."""

    def __init__(self, source, chunk_size, cdtype, temperature, weight=None):
        self.source, self.flat, self.weight = source, _flat_view(source), weight
        self.chunk_size, self.cdtype, self.temperature = chunk_size, cdtype, temperature

    def __call__(self, s, e):
        rows = _rows(self.source, self.flat, s, e)
        if self.weight is None:
            # copy=True: z must be a fresh buffer even for fp32 input, it is overwritten downstream.
            z = rows.to(self.cdtype, copy=True)
        else:
            z = (rows @ self.weight.t()).to(self.cdtype)  # matmul in the input dtype
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z


# ------------------------------------------------------------------------------------ from the logits
class _VocabParallelLogprobs(torch.autograd.Function):
    """Chunked log-probs and entropies from vocab-parallel logits; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, group, chunk_size, temperature, compute_entropy):
        batch, seq, vocab_local = logits.shape
        cdtype = _compute_dtype(logits.dtype)
        index, owned = _label_index(labels, group, vocab_local, cdtype)
        logp, lse, mean_z, ent = _chunked_forward(
            batch * seq, _ChunkLogits(logits, chunk_size, cdtype, temperature), index, owned, group,
            compute_entropy, cdtype, logits.device)
        ctx.save_for_backward(logits, index, owned, lse, mean_z)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.set_materialize_grads(False)
        ent = ent.view(batch, seq) if compute_entropy else None
        return logp.view(batch, seq), ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, index, owned, lse, mean_z = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return (None,) * 6
        cdtype = lse.dtype
        g_logp = None if g_logp is None else g_logp.reshape(-1).to(cdtype)
        g_ent = None if g_ent is None else g_ent.reshape(-1).to(cdtype)
        chunk_logits = _ChunkLogits(logits, ctx.chunk_size, cdtype, ctx.temperature)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(-1, logits.shape[-1])
        for s, e in _chunk_bounds(lse.numel(), ctx.chunk_size):
            grad_flat[s:e].copy_(_chunk_grad(chunk_logits(s, e), s, e, index, owned, lse, mean_z,
                                             g_logp, g_ent, ctx.temperature))
        return grad, None, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: ProcessGroup = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probabilities of ``labels`` and entropies of ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V_local]`` this rank's vocabulary shard (rank r holds ids
            ``[r * V_local, (r+1) * V_local)``), any float dtype; never modified.
        labels: ``[B, T]`` int64 global token ids, already shifted (``labels[:, t]`` is the token predicted
            at position t).
        tp_group: the tensor-parallel group the vocabulary is split over; None = the full vocabulary is
            local.
        chunk_size: tokens (over the flattened ``B * T``) upcast to fp32 at a time.
        temperature: the sampling temperature; logits are divided by it before the softmax.
        compute_entropy: if False, the entropy is not computed and None is returned for it.

    Returns:
        ``logp, entropy``: ``[B, T]`` float32 (float64 for float64 logits), identical on all TP ranks;
        differentiable w.r.t. ``logits`` (each rank gets the gradient of its own shard, complete, no
        further reduction needed). Double backward is not supported.
    """
    _check_args("logits", logits, labels, chunk_size, temperature)
    return _VocabParallelLogprobs.apply(logits, labels, tp_group, chunk_size, float(temperature),
                                        compute_entropy)


# ------------------------------------------------------------------------------ from the hidden state
class _HiddenVocabParallelLogprobs(torch.autograd.Function):
    """Like ``_VocabParallelLogprobs`` but each chunk's logits are ``hidden_chunk @ weight.T``."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, chunk_size, temperature, compute_entropy):
        batch, seq, _ = hidden.shape
        cdtype = _compute_dtype(hidden.dtype)
        index, owned = _label_index(labels, group, weight.shape[0], cdtype)
        logp, lse, mean_z, ent = _chunked_forward(
            batch * seq, _ChunkLogits(hidden, chunk_size, cdtype, temperature, weight=weight), index,
            owned, group, compute_entropy, cdtype, hidden.device)
        ctx.save_for_backward(hidden, weight, index, owned, lse, mean_z)
        ctx.group, ctx.chunk_size, ctx.temperature = group, chunk_size, temperature
        ctx.set_materialize_grads(False)
        ent = ent.view(batch, seq) if compute_entropy else None
        return logp.view(batch, seq), ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, index, owned, lse, mean_z = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 7
        cdtype = lse.dtype
        g_logp = None if g_logp is None else g_logp.reshape(-1).to(cdtype)
        g_ent = None if g_ent is None else g_ent.reshape(-1).to(cdtype)
        chunk_logits = _ChunkLogits(hidden, ctx.chunk_size, cdtype, ctx.temperature, weight=weight)
        flat = chunk_logits.flat
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The weight gradient sums over all chunks: accumulate in fp32 (like megatron's main_grad),
        # each chunk's product itself is computed in the input dtype.
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None
        for s, e in _chunk_bounds(lse.numel(), ctx.chunk_size):
            h = _rows(hidden, flat, s, e)
            gz = _chunk_grad(chunk_logits(s, e), s, e, index, owned, lse, mean_z, g_logp, g_ent,
                             ctx.temperature)
            gz = gz.to(hidden.dtype)  # the gradient of the (input-dtype) logits chunk
            if need_h:
                grad_h.view(-1, hidden.shape[-1])[s:e] = gz @ weight
            if need_w:
                if gz.dtype == cdtype:
                    grad_w.addmm_(gz.t(), h)
                else:
                    grad_w += gz.t() @ h
        if need_h:
            # Each rank's grad_h is the partial sum over its vocabulary shard; the hidden state is the
            # same input on all TP ranks, so its full gradient is the sum over ranks (done here, see
            # logprobs_from_hidden).
            _all_reduce(grad_h, dist.ReduceOp.SUM, ctx.group)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: ProcessGroup = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logprobs_and_entropy(hidden @ output_weight.T, ...)`` without materialising the logits.

    Args:
        hidden: ``[B, T, H]`` final hidden state (after the final norm), the same full sequence on every
            TP rank.
        output_weight: ``[V_local, H]`` this rank's shard of the output layer (megatron's
            ``output_layer.weight``, or the shared embedding weight), same dtype as ``hidden``.
        labels, tp_group, chunk_size, temperature, compute_entropy: as in ``logprobs_and_entropy``.

    Gradients: ``output_weight`` gets the gradient of its own shard. ``hidden`` gets its *complete*
    gradient: the per-shard partial sums are all-reduced over ``tp_group`` inside the backward. So call
    this on the hidden state directly, NOT through megatron's ``copy_to_tensor_model_parallel_region``
    (whose backward all-reduces again and would multiply the gradient by tp). Under sequence parallelism
    gather the hidden state with ``gather_from_sequence_parallel_region(h,
    tensor_parallel_output_grad=False)``, whose backward slices instead of reduce-scattering.

    Returns ``logp, entropy: [B, T]`` float32 (float64 for float64 input).
    """
    _check_args("hidden", hidden, labels, chunk_size, temperature)
    if output_weight.dim() != 2 or output_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"output_weight must be [V_local, H={hidden.shape[-1]}], "
                         f"got {tuple(output_weight.shape)}")
    if output_weight.dtype != hidden.dtype:
        raise ValueError(f"output_weight dtype {output_weight.dtype} != hidden dtype {hidden.dtype}")
    return _HiddenVocabParallelLogprobs.apply(hidden, output_weight, labels, tp_group, chunk_size,
                                              float(temperature), compute_entropy)
