"""CompPO's transport gate from final-layer attention concentration (DESIGN.md, "CompPO").

    H_t = sum_i a_ti**2                (mean over query heads; a_t: causal attention of query t)
    c_t = (H_t - 1/n_t) / (1 - 1/n_t)  (n_t visible keys; 0 = uniform attention, 1 = one key)
    kappa_t = k_lo + (k_hi - k_lo) * sigmoid(tau * (c_t - 1/2))

A query that sees one key (``n_t = 1``) is fully concentrated by definition: ``c_t = 1``. ``H`` itself
comes from two online log-sum-exps, ``sum_i a_i**2 = exp(LSE(2 s) - 2 LSE(s))`` for scores ``s``, which
the model code computes over key chunks; :func:`concentration_from_lse` is that last step.

>>> import torch
>>> comppo_gate(torch.tensor([0.25, 1.0]), torch.tensor([4, 4]), tau=4.0)
tensor([0.1954, 0.8046])
"""
from __future__ import annotations

import torch


def concentration_from_lse(lse_2s: torch.Tensor, lse_s: torch.Tensor) -> torch.Tensor:
    """``H = sum_i softmax(s)_i**2 = exp(LSE(2 s) - 2 LSE(s))``; inputs and output of any equal shape."""
    return torch.exp(lse_2s - 2.0 * lse_s)


def normalized_concentration(h: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """``c = (H - 1/n) / (1 - 1/n)``, 1 where ``n <= 1``; ``h, n_visible`` broadcastable."""
    inv_n = 1.0 / n_visible.to(h.dtype).clamp(min=1.0)
    denom = (1.0 - inv_n).clamp(min=torch.finfo(h.dtype).tiny)  # where n == 1 the result is replaced
    return torch.where(n_visible > 1, (h - inv_n) / denom, torch.ones_like(h))


def comppo_gate(h: torch.Tensor, n_visible: torch.Tensor, *, k_lo: float = 0.1, k_hi: float = 0.9,
               tau: float = 4.0) -> torch.Tensor:
    """Gate ``kappa`` (detached) from concentration ``h`` and visible-key counts ``n_visible``."""
    if not 0.0 <= k_lo <= k_hi <= 1.0:
        raise ValueError(f"need 0 <= k_lo <= k_hi <= 1, got k_lo={k_lo}, k_hi={k_hi}")
    c = normalized_concentration(h.detach(), n_visible)
    return k_lo + (k_hi - k_lo) * torch.sigmoid(tau * (c - 0.5))
