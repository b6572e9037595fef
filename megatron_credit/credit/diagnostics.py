"""How a response's credit is spread over its tokens (``docs/credit_maps.md`` "Diagnostics").

For one response with per-token credit ``x_t = |A_t|`` on its ``L`` valid tokens (``A``: the advantage the
loss applies to the token, e.g. FIPO's ``f_t * A_t``):

- ``gini``: the Gini coefficient ``sum_{i,j} |x_i - x_j| / (2 L sum_i x_i)``, computed from the sorted
  values as ``2 sum_i i x_(i) / (L sum x) - (L + 1) / L`` (``i = 1..L`` ascending). 0 when every token gets
  the same credit (GRPO), ``1 - 1/L`` when one token gets all of it.
- ``effective_frac``: the effective sample size ``(sum x)^2 / sum x^2`` over ``L``; 1 for equal credit,
  ``1/L`` for one token.
- ``position_corr``: Pearson's correlation of ``x_t`` with the token's index in the response ``0..L-1``;
  0 when either is constant (equal credit, or ``L = 1``).

A response without credit (``sum x = 0``: a group whose responses all scored alike) has none of these; the
averages are over the responses with credit. Pure torch, no host sync.

>>> import torch
>>> adv = torch.tensor([[0.5, 0.5, 0.5, 0.0], [0.0, 0.0, 3.0, 0.0]])
>>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
>>> d = per_response(adv, mask)
>>> [round(float(v), 4) for v in d["gini"]], [round(float(v), 4) for v in d["effective_frac"]]
([0.0, 0.6667], [1.0, 0.3333])
>>> [round(float(v), 4) for v in d["position_corr"]], d["has_credit"].tolist()
([0.0, 0.866], [True, True])
"""
from __future__ import annotations

import torch

_EPS = 1e-12


def per_response(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module docstring's diagnostics of each response.

    Args:
        advantages: ``[N, T]`` per-token advantages (any float dtype; computed in float64).
        mask: ``[N, T]`` bool or 0/1, 1 on the response's valid tokens (need not be contiguous).
    Returns:
        ``gini``, ``effective_frac``, ``position_corr``: ``[N]`` float64 (0 where ``has_credit`` is False);
        ``has_credit``: ``[N]`` bool, the response has a valid token with ``A != 0``.
    """
    m = mask.bool()
    x = torch.where(m, advantages.detach().double().abs(), 0.0)
    n = m.sum(dim=1).double()
    s = x.sum(dim=1)
    has = s > 0
    safe_n, safe_s = n.clamp(min=1), s.clamp(min=_EPS)
    # Gini from the ascending sort: masked slots sort first as -1, so the valid ones hold ranks 1..L at the end
    srt = torch.sort(torch.where(m, x, -1.0), dim=1).values.clamp(min=0)
    rank = torch.arange(1, x.shape[1] + 1, dtype=torch.float64, device=x.device) - (x.shape[1] - n)[:, None]
    gini = 2 * (rank.clamp(min=0) * srt).sum(dim=1) / (safe_n * safe_s) - (safe_n + 1) / safe_n
    eff = s * s / (x * x).sum(dim=1).clamp(min=_EPS) / safe_n
    # position: the token's index among the response's valid tokens
    pos = torch.where(m, torch.cumsum(m.double(), dim=1) - 1, 0.0)
    dx = torch.where(m, x - (s / safe_n)[:, None], 0.0)
    dp = torch.where(m, pos - (pos.sum(dim=1) / safe_n)[:, None], 0.0)
    cov, vx, vp = (dx * dp).sum(dim=1), (dx * dx).sum(dim=1), (dp * dp).sum(dim=1)
    # relative tolerance: a constant |A| leaves rounding noise in vx, which must not become a correlation
    flat = vx <= 1e-20 * (x * x).sum(dim=1).clamp(min=_EPS) * safe_n
    corr = torch.where(flat | (vp <= 0), 0.0, cov / (vx * vp).clamp(min=_EPS).sqrt())
    zero = torch.zeros_like(s)
    return {"gini": torch.where(has, gini.clamp(min=0), zero), "effective_frac": torch.where(has, eff, zero),
            "position_corr": torch.where(has, corr, zero), "has_credit": has}


def credit_sums(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum:`` statistics of :func:`per_response` over the responses with credit (``[]`` tensors each),
    which the trainer sums over ranks; ``credit/<name>`` is ``sum:credit/<name> / sum:credit/responses``
    (``metrics/tables.CORE``)."""
    d = per_response(advantages, mask)
    has = d.pop("has_credit")
    out = {f"sum:credit/{k}": torch.where(has, v, 0.0).sum() for k, v in d.items()}
    out["sum:credit/responses"] = has.sum().double()
    return out


TURN_STATS = 8
"""Turns with advantage statistics of their own; later turns are counted in the last one."""


def turn_sums(advantages: torch.Tensor, mask: torch.Tensor, turn_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum:`` statistics of the applied advantages per turn index of multi-turn trajectories (the action
    tokens of turn ``k``, ``k < TURN_STATS``; the last index holds every later turn): their sum, absolute sum
    and count; ``advantage/turn_<k>_mean`` and ``_abs_mean`` are their ratios (``metrics/tables.CORE``).

    >>> adv = torch.tensor([[1.0, 0.0, -2.0]]); m = torch.tensor([[True, False, True]])
    >>> s = turn_sums(adv, m, torch.tensor([[0, 0, 1]]))
    >>> float(s["sum:turn_adv/0/sum"]), float(s["sum:turn_adv/1/abs"]), float(s["sum:turn_adv/1/tokens"])
    (1.0, 2.0, 1.0)
    """
    a = advantages.detach().double()
    turns = turn_ids.clamp(max=TURN_STATS - 1)
    out = {}
    for k in range(TURN_STATS):
        sel = mask.bool() & (turns == k)
        out[f"sum:turn_adv/{k}/sum"] = torch.where(sel, a, 0.0).sum()
        out[f"sum:turn_adv/{k}/abs"] = torch.where(sel, a.abs(), 0.0).sum()
        out[f"sum:turn_adv/{k}/tokens"] = sel.sum().double()
    return out


def advantage_sums(advantages: torch.Tensor, mask: torch.Tensor,
                   turn_ids: "torch.Tensor | None" = None) -> dict[str, torch.Tensor]:
    """Every ``sum:`` statistic of the applied advantages, to be added to the iteration's sums at once:
    :func:`credit_sums`, and with ``turn_ids`` (``[B, T]``, a multi-turn batch) :func:`turn_sums` (the keys
    are disjoint).

    >>> adv = torch.tensor([[1.0, 0.0, -2.0]]); m = torch.tensor([[True, False, True]])
    >>> sorted(advantage_sums(adv, m)) == sorted(credit_sums(adv, m))
    True
    >>> len(advantage_sums(adv, m, torch.tensor([[0, 0, 1]]))) == len(credit_sums(adv, m)) + 3 * TURN_STATS
    True
    """
    out = credit_sums(advantages, mask)
    if turn_ids is not None:  # multi-turn: the credit each turn index gets
        out.update(turn_sums(advantages, mask, turn_ids))
    return out
