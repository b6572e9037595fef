"""Rollout-vs-trainer log-prob mismatch (pure tensor functions).

The rollout engine samples from pi_engine; the trainer recomputes pi_old with its own kernels (and,
with vLLM's default, the engine's log-probs are even renormalised after top-k/top-p). The difference
is logged every step with :func:`logprob_mismatch`; the loss can correct it with the truncated
importance-sampling weights of :func:`megatron_credit.losses.importance.truncated_is_weights`.

>>> e = torch.tensor([[-1.0, -2.0, 0.0]]); t = torch.tensor([[-1.5, -2.0, 9.0]]); m = torch.tensor([[1, 1, 0]])
>>> out = logprob_mismatch(e, t, m)
>>> round(float(out["mean_abs_diff"]), 4), round(float(out["max_abs_diff"]), 4), out["seq_kl_k1"].tolist()
(0.25, 0.5, [0.25])
"""
from __future__ import annotations

import torch

from megatron_credit.credit.future_kl import LOG_RATIO_CLAMP as _LOG_RATIO_CLAMP


def logprob_mismatch(
    engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mismatch statistics between engine and trainer log-probs of the same sampled tokens.

    engine_logp, trainer_logp: [B, T] log-probs of the sampled tokens; mask: [B, T] (bool or 0/1),
    1 on response tokens. Tokens are samples of the engine, so with ``d = trainer - engine``:
    k1 = -d and k3 = exp(d) - 1 - d are estimators of KL(pi_engine || pi_trainer) per token (k3 is
    unbiased and never negative). Returns detached tensors (no host sync):

    - ``mean_abs_diff`` []: token-mean of |engine - trainer| over the batch;
    - ``max_abs_diff`` []: its maximum (0 for an empty mask);
    - ``kl_k3`` []: token-mean of k3 over the batch;
    - ``seq_kl_k1`` [B], ``seq_kl_k3`` [B]: per-sequence token-means (0 for an empty sequence);
    - ``abs_diff_sum`` []: the sum of |engine - trainer| behind ``mean_abs_diff``, which the trainer sums
      over ranks with the token count (``mismatch/logprob_abs_mean``).
    """
    m = mask.to(engine_logp.dtype)
    d = (trainer_logp - engine_logp).detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) * m
    abs_d = d.abs()
    k3 = (torch.expm1(d) - d) * m
    tokens_per_seq = m.sum(dim=-1)
    total = tokens_per_seq.sum().clamp_min(1.0)
    per_seq = tokens_per_seq.clamp_min(1.0)
    return {
        "mean_abs_diff": abs_d.sum() / total,
        "max_abs_diff": abs_d.amax() if abs_d.numel() else abs_d.sum(),
        "kl_k3": k3.sum() / total,
        "seq_kl_k1": -d.sum(dim=-1) / per_seq,
        "seq_kl_k3": k3.sum(dim=-1) / per_seq,
        "abs_diff_sum": abs_d.sum(),
    }
