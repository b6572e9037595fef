"""KL penalty estimators to a frozen reference policy, per token (Schulman's k1 / k3; verl's low_var_kl).

``logp, ref_logp: [B, T]`` -> ``[B, T]``; the trainer adds ``kl_coef`` times the estimate to the per-token
policy loss (``algorithm.kl_coef``, ``algorithm.kl_estimator``).

>>> lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
>>> KL_ESTIMATORS.get("k1")(lp, ref).tolist(), [round(v, 4) for v in kl_k3(lp, ref)[0].tolist()]
([[0.5, 0.0]], [0.1065, 0.0])
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_credit.credit.future_kl import LOG_RATIO_CLAMP
from megatron_credit.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` (unbiased, can be negative)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r`` with ``r = pi_ref / pi`` (unbiased, never negative)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10] (verl's ``low_var_kl``)."""
    return kl_k3(logp, ref_logp).clamp(-10.0, 10.0)
