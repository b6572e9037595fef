"""One reduction of per-token losses to a scalar, with denominators passed in.

Under gradient accumulation and data/context parallelism each micro-batch on each rank sees only part of
the batch. If every call divided by its *local* token count, the gradient would depend on how the batch
was split (the "token-mean per micro-batch" trap in docs/architecture.md). Here the denominators are arguments:
the trainer computes them once per step, summed over DP x CP and all micro-batches, and the sum of
``aggregate_loss`` over micro-batches and ranks is then exactly the loss of the whole batch.

Modes (one row = one response; ``l`` per-token loss, ``m`` mask, ``N_tok``/``N_seq`` global counts):

- ``token-mean``:              ``sum_{i,t} l m / N_tok``                         (DAPO)
- ``seq-mean-token-sum``:      ``sum_i (sum_t l m) / N_seq``
- ``seq-mean-token-mean``:     ``sum_i (sum_t l m / sum_t m) / N_seq``           (GRPO, GSPO)
- ``seq-mean-token-sum-norm``: ``sum_{i,t} l m / (N_seq * L)``, L a fixed length (Dr.GRPO: the
  maximum response length of the run); ``norm_length`` is required

Arguments that cannot silently be wrong (docs/architecture.md "Known traps": loss scaled by CP size or by the
micro-batch split):

- ``norm_length`` has no default. The tensor's ``T`` would be this rank's CP share (``T_global / cp``)
  or a micro-batch's padded length, so a default would scale the loss by ``cp`` or by the padding.
- ``seq-mean-token-mean`` with ``global_num_seqs`` (i.e. in a distributed / accumulated step) requires
  ``seq_num_tokens``, each whole response's token count: under CP the local ``mask.sum(-1)`` counts only
  this rank's share of a row and would scale each response's mean by up to ``cp``.
- Without ``global_num_tokens`` / ``global_num_seqs`` the local counts are used, which is correct only
  when there is one micro-batch on one rank (tests, single-process tools).

Rows with no valid tokens contribute 0. Masked positions are removed by selection, so NaN or inf in
padding never reaches the loss or its gradient.

>>> import torch
>>> l = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]); m = torch.tensor([[1, 1, 0], [1, 0, 0]])
>>> aggregate_loss(l, m, mode="token-mean")
tensor(2.)
>>> aggregate_loss(l, m, mode="seq-mean-token-mean")
tensor(2.)
>>> aggregate_loss(l, m, mode="token-mean", global_num_tokens=6)
tensor(1.)
>>> aggregate_loss(l, m, mode="seq-mean-token-sum-norm", norm_length=4)
tensor(0.7500)
"""
from __future__ import annotations

from typing import Optional, Union

import torch

Count = Union[torch.Tensor, int, float]
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# What a distributed / accumulated step must pass for each mode (computed once per step over DP x CP).
AGG_REQUIRED_ARGS = {
    "token-mean": ("global_num_tokens",),
    "seq-mean-token-sum": ("global_num_seqs",),
    "seq-mean-token-mean": ("global_num_seqs", "seq_num_tokens"),
    "seq-mean-token-sum-norm": ("global_num_seqs", "norm_length"),
}


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, *, mode: str,
                   global_num_tokens: Optional[Count] = None, global_num_seqs: Optional[Count] = None,
                   norm_length: Optional[int] = None,
                   seq_num_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reduce ``per_token: [B, T]`` over ``mask: [B, T]`` to a scalar (see module docstring).

    Args:
        mode: one of ``AGG_MODES``.
        global_num_tokens: valid tokens in the whole step (all micro-batches, DP x CP ranks).
        global_num_seqs: responses in the whole step (count each response once, not once per CP rank).
        norm_length: ``L`` of ``seq-mean-token-sum-norm`` (the maximum response length); required there.
        seq_num_tokens: ``[B]`` valid tokens of each whole response for ``seq-mean-token-mean``; required
            with ``global_num_seqs`` (under CP a rank sees only part of each row). Without
            ``global_num_seqs`` the default is ``mask.sum(-1)``.
    """
    valid = mask.bool()
    m = valid.to(per_token.dtype)
    masked = torch.where(valid, per_token, 0.0)
    if mode == "token-mean":
        denom = m.sum() if global_num_tokens is None else global_num_tokens
        return masked.sum() / _clamp1(denom, per_token)
    nseq = per_token.shape[0] if global_num_seqs is None else global_num_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / _clamp1(nseq, per_token)
    if mode == "seq-mean-token-mean":
        # Under CP a row's token count must be the whole response's (seq_num_tokens). Empty rows: 0 / 1.
        if seq_num_tokens is None and global_num_seqs is not None:
            raise ValueError("seq-mean-token-mean with global_num_seqs needs seq_num_tokens ([B] token "
                             "counts of the whole responses); the local mask.sum(-1) is wrong under CP")
        counts = m.sum(-1) if seq_num_tokens is None else seq_num_tokens.to(per_token.dtype)
        per_seq = masked.sum(-1) / counts.clamp(min=1)
        return per_seq.sum() / _clamp1(nseq, per_token)
    if mode == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError("seq-mean-token-sum-norm needs norm_length (the fixed L of Dr.GRPO, e.g. the "
                             "maximum response length); the local T would scale the loss by CP size")
        if not norm_length > 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length}")
        return masked.sum() / (_clamp1(nseq, per_token) * norm_length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")


def _clamp1(x: Count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device).clamp(min=1)
