"""The critic's value loss (PPO, CompPO): a pure function of tensors and explicit keywords.

``L_V = 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``, token-mean over the step's
global token count (``global_num_tokens``, summed over DP once per optimizer step), so the sum over
micro-batches and ranks is the mini-batch's loss whatever the split.

>>> v, old, ret = torch.tensor([[0.5, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
>>> loss, m = clipped_value_loss(v, old, ret, torch.tensor([[True, True]]), value_clip=0.2,
...                              global_num_tokens=torch.tensor(2.0))
>>> round(float(loss), 4), float(m["ret"])  # 0.5 * mean(max(0.25, 0.64), 1.0) = 0.41
(0.41, 2.0)
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_credit.losses.aggregation import aggregate_loss


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       *, value_clip: Optional[float], global_num_tokens: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``[]`` of ``values, old_values, returns, mask: [B, T]`` (``value_clip=None``:
    unclipped), and detached sums over this rank's valid tokens for the critic's metrics: ``value_loss``
    (the loss itself), ``ret`` / ``ret2`` (returns and their squares), ``resid`` / ``resid2`` (returns
    minus the old values, and squares) from which ``critic/explained_var`` is computed over the batch."""
    err = (values - returns) ** 2
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    loss = 0.5 * aggregate_loss(err, mask, mode="token-mean", global_num_tokens=global_num_tokens)
    # float64 sums: the variances are E[x^2] - E[x]^2, which cancel when the returns are nearly constant
    r = torch.where(mask, returns, 0.0).detach().double()
    resid = torch.where(mask, returns - old_values, 0.0).detach().double()
    return loss, {"value_loss": loss.detach(), "ret": r.sum(), "ret2": (r * r).sum(),
                  "resid": resid.sum(), "resid2": (resid * resid).sum()}
