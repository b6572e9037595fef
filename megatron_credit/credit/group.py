"""Group-relative advantages: one score per response, compared within its prompt's group.

- GRPO: ``(s - mean_g) / (std_g + eps)`` with the unbiased std (``norm_by_std=False``: ``s - mean_g``).
- Dr.GRPO: ``s - mean_g`` (no std normalisation; its length bias fix is in the aggregation mode).
- RLOO: ``s - mean of the other members of the group`` = ``n/(n-1) (s - mean_g)``.

A group with a single member has advantage 0 in every variant (there is nothing to compare against).
Group ids are arbitrary integers; one response per row. :func:`broadcast_to_tokens` spreads a
response-level advantage over its tokens.

>>> import torch
>>> s = torch.tensor([1.0, 0.0, 1.0, 5.0]); g = torch.tensor([7, 7, 7, 3])
>>> grpo_advantages(s, g, norm_by_std=False)
tensor([ 0.3333, -0.6667,  0.3333,  0.0000])
>>> rloo_advantages(s, g)
tensor([ 0.5000, -1.0000,  0.5000,  0.0000])
"""
from __future__ import annotations

import torch


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-response ``(group size n, group mean, unbiased group variance)``, each ``[N]``."""
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores and group_ids must both be [N], got {tuple(scores.shape)} and "
                         f"{tuple(group_ids.shape)}")
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    count = scores.new_zeros(g).index_add_(0, inv, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inv, scores)
    mean = (total / count)[inv]
    sq = torch.zeros_like(count).index_add_(0, inv, (scores - mean) ** 2)
    n = count[inv]
    var = sq[inv] / (n - 1).clamp(min=1)
    return n, mean, var


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, *, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages ``[N]`` from scores ``[N]`` and group ids ``[N]`` (unbiased std)."""
    n, mean, var = _group_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (var.sqrt() + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).detach()


def dr_grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages ``[N]``: ``s - mean_g`` (no std normalisation)."""
    return grpo_advantages(scores, group_ids, norm_by_std=False)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO advantages ``[N]``: score minus the mean of the other ``n - 1`` members of its group."""
    n, mean, _ = _group_stats(scores, group_ids)
    adv = (scores - mean) * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, adv, torch.zeros_like(adv)).detach()


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token advantages ``[N, T]``: each response's ``advantages[N]`` on its tokens, 0 elsewhere."""
    return advantages[:, None] * response_mask.to(advantages.dtype)
