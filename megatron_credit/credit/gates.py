"""CompPO's transport gate from final-layer attention concentration (docs/architecture.md, "CompPO").

    H_t = sum_i a_ti**2                (mean over query heads; a_t: causal attention of query t)
    c_t = (H_t - 1/n_t) / (1 - 1/n_t)  (n_t visible keys; 0 = uniform attention, 1 = one key)
    kappa_t = k_lo + (k_hi - k_lo) * sigmoid(tau * (c_t - 1/2))

A query that sees one key (``n_t = 1``) is fully concentrated by definition: ``c_t = 1``. ``H`` itself
comes from two online log-sum-exps, ``sum_i a_i**2 = exp(LSE(2 s) - 2 LSE(s))`` for scores ``s``, which
the model code computes over key chunks; :func:`concentration_from_lse` is that last step.

The factorial's controls replace the dynamic gate: :func:`fixed_gates`, :func:`shuffle_gates` and the
frozen :class:`PositionGateSchedule`.

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


# --- Gate controls for the factorial (docs/architecture.md "CompPO": fixed, shuffled, position-only) -----------------
# Each control keeps one property of the dynamic gate and destroys the rest: ``fixed`` keeps only the mean,
# ``shuffle`` keeps the batch's exact distribution of gates but not which token carries which, ``position``
# keeps only how the gate depends on relative position t/T.


def fixed_gates(mask: torch.Tensor, value: float) -> torch.Tensor:
    """``[B, T]`` float32: ``value`` on valid tokens (``mask: [B, T]`` bool), 0 elsewhere.

    >>> fixed_gates(torch.tensor([[True, True, False]]), 0.61)
    tensor([[0.6100, 0.6100, 0.0000]])
    """
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"fixed_gate must be in [0, 1], got {value}")
    return torch.where(mask.bool(), torch.tensor(value, dtype=torch.float32, device=mask.device),
                       torch.zeros((), dtype=torch.float32, device=mask.device))


def shuffle_gates(kappa: torch.Tensor, mask: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """One uniform permutation of the valid positions' gates across all rows of the batch.

    ``kappa: [B, T]``, ``mask: [B, T]`` bool; returns ``[B, T]`` (``kappa``'s dtype, detached) holding
    exactly the multiset ``kappa[mask]`` on the valid positions and 0 on the others. ``generator`` lives
    on the CPU (the permutation is drawn there, so a seed gives the same shuffle on any device).

    >>> k = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0]])
    >>> m = torch.tensor([[True, True, False], [True, False, False]])
    >>> out = shuffle_gates(k, m, generator=torch.Generator().manual_seed(0))
    >>> sorted(out[m].tolist()) == sorted(k[m].tolist()), bool((out[~m] == 0).all())
    (True, True)
    """
    if kappa.shape != mask.shape:
        raise ValueError(f"kappa {tuple(kappa.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.bool()
    valid = kappa.detach()[mask]  # row-major order over the whole batch
    perm = torch.randperm(valid.numel(), generator=generator).to(valid.device)
    out = torch.zeros_like(kappa, dtype=kappa.dtype).detach()
    out[mask] = valid[perm]
    return out


def relative_position_bins(mask: torch.Tensor, bins: int) -> torch.Tensor:
    """``[B, T]`` int64 bin of each valid token's relative position in its response, -1 on masked ones.

    ``t`` counts the row's valid tokens before this one (``[0, T_b)``, ``T_b`` = the row's valid tokens), so
    left or right padding give the same bins; ``bin = floor(bins * t / T_b)`` in exact integer arithmetic.

    >>> relative_position_bins(torch.tensor([[False, True, True, True, True]]), 2)
    tensor([[-1,  0,  0,  1,  1]])
    """
    mask = mask.bool()
    t = torch.cumsum(mask.long(), dim=1) - 1
    length = mask.long().sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(mask, torch.div(bins * t, length, rounding_mode="floor"), torch.full_like(t, -1))


class PositionGateSchedule:
    """The ``position`` control: mean gate per bin of relative position t/T, collected then frozen.

    ``collect`` adds a batch's dynamic gates to per-bin sums and counts (all-reduced over ``group``, the DP
    group, so every rank builds the same schedule); after ``freeze()``, ``gates(mask)`` returns the frozen
    bin means: a piecewise-constant function of t/T in ``bins`` pieces. A bin that never received a token
    takes the overall mean gate. Rows are whole responses (not context-parallel shards).

    >>> s = PositionGateSchedule(bins=2)
    >>> s.collect(torch.tensor([[0.2, 0.4, 0.6, 0.8]]), torch.ones(1, 4, dtype=torch.bool))
    >>> s.freeze()
    >>> s.gates(torch.tensor([[True, True, True, False]]))
    tensor([[0.3000, 0.3000, 0.7000, 0.0000]])
    """

    def __init__(self, bins: int = 20):
        if bins < 1:
            raise ValueError(f"position_bins must be >= 1, got {bins}")
        self.bins = bins
        self._sum = torch.zeros(bins, dtype=torch.float64)
        self._count = torch.zeros(bins, dtype=torch.float64)
        self._means: torch.Tensor | None = None

    @property
    def frozen(self) -> bool:
        return self._means is not None

    def collect(self, kappa: torch.Tensor, mask: torch.Tensor, *, group=None, device=None) -> None:
        """Accumulate ``kappa: [B, T]`` over valid tokens (``mask: [B, T]``) into the bins. ``device``: where
        the all-reduce over ``group`` runs (NCCL reduces device tensors only, and the trainer's batch lives
        in host memory); default ``kappa``'s device."""
        if self.frozen:
            raise RuntimeError("PositionGateSchedule.collect after freeze()")
        if kappa.shape != mask.shape:
            raise ValueError(f"kappa {tuple(kappa.shape)} and mask {tuple(mask.shape)} must have the same shape")
        idx = relative_position_bins(mask, self.bins)
        valid = idx >= 0
        stats = torch.zeros(2, self.bins, dtype=torch.float64, device=kappa.device)
        stats[0].index_add_(0, idx[valid], kappa.detach()[valid].double())
        stats[1].index_add_(0, idx[valid], torch.ones_like(kappa[valid], dtype=torch.float64))
        if group is not None:
            import torch.distributed as dist

            stats = stats.to(device if device is not None else kappa.device)
            dist.all_reduce(stats, group=group)
        stats = stats.cpu()  # once per iteration, while collecting: the schedule is tiny host state
        self._sum += stats[0]
        self._count += stats[1]

    def freeze(self) -> None:
        """Fix the schedule to the bin means collected so far."""
        total = float(self._count.sum())
        if total == 0:
            raise RuntimeError("PositionGateSchedule.freeze with no gates collected")
        overall = float(self._sum.sum()) / total
        self._means = torch.where(self._count > 0, self._sum / self._count.clamp(min=1.0),
                                  torch.full_like(self._sum, overall))

    def gates(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` float32: the frozen mean of each valid token's bin, 0 on masked tokens."""
        if not self.frozen:
            raise RuntimeError("PositionGateSchedule.gates before freeze()")
        idx = relative_position_bins(mask, self.bins)
        means = self._means.to(device=mask.device, dtype=torch.float32)
        return torch.where(idx >= 0, means[idx.clamp(min=0)], torch.zeros((), device=mask.device))

    def state_dict(self) -> dict:
        return {"bins": self.bins, "sum": self._sum.tolist(), "count": self._count.tolist(),
                "means": None if self._means is None else self._means.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state["bins"] != self.bins:
            raise ValueError(f"position_bins={self.bins} but the checkpoint's schedule has {state['bins']} bins")
        self._sum = torch.tensor(state["sum"], dtype=torch.float64)
        self._count = torch.tensor(state["count"], dtype=torch.float64)
        self._means = None if state["means"] is None else torch.tensor(state["means"], dtype=torch.float64)
