"""GAE (PPO) and Comp-GAE (CompPO) as one transport scan.

Comp-GAE (docs/architecture.md, "CompPO") replaces the discount by a per-token gate ``kappa_t``:

    delta_t = r_t + kappa_t V_{t+1} m_{t+1} - V_t m_t
    A_t     = delta_t + lam kappa_t A_{t+1} m_{t+1}          (A_T = 0)
    R_t     = A_t + V_t                                       (on valid tokens)

GAE is the special case ``kappa_t = gamma``.

Multi-turn trajectories (``obs_mask``, docs/multi_turn.md): the environment's tokens between turns are
transparent. The recurrence runs over the policy's tokens only: the token before an observation takes
``V`` and ``A`` of the first action token after it (``V_{t+1}`` above is the *next action token's* value),
with one step of ``lam kappa_t`` (``gamma`` for GAE) however long the observation is; an observation
holds no value, reward or advantage of its own. Both the next action's value and the transport across
observations are reverse scans (an observation passes its successor's ``V m`` and ``A`` on unchanged),
so CP needs nothing more. Both are :func:`reverse_linear_scan` with evidence
``delta`` and transport ``lam * kappa_t * m_{t+1}``; a masked next token cuts the recurrence, so rows may
hold packed responses separated by masked tokens. Advantages and returns are 0 on masked tokens.

Context parallel (``cp_group``, megatron's load-balanced chunk order as in :func:`reverse_linear_scan`): the
transport at a chunk's last token needs ``m`` and ``V`` of the next chunk's first token, a halo. Each
rank all-gathers the first token's ``(V m, m)`` of its two chunks (4*B scalars), takes the halo of each
of its chunks from that, and then runs the CP scan. Communication stays O(B*cp).

>>> import torch
>>> r = torch.tensor([[0.0, 0.0, 1.0]]); v = torch.zeros(1, 3); m = torch.ones(1, 3)
>>> gae(r, v, m, gamma=1.0, lam=1.0)[0]
tensor([[1., 1., 1.]])
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_credit.credit.scan import reverse_linear_scan


def comp_gae(rewards: torch.Tensor, values: torch.Tensor, gates: torch.Tensor,
             response_mask: torch.Tensor, *, lam: float, chunk_size: int = 128,
             cp_group: Any = None, obs_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Comp-GAE advantages and returns, both ``[B, T]`` and detached.

    Args:
        rewards: ``r: [B, T]`` per-token rewards (typically the score on the last response token).
        values: ``V: [B, T]`` critic values.
        gates: ``kappa: [B, T]`` per-token transport gates in [0, 1] (detached, behaviour policy).
        response_mask: ``m: [B, T]`` bool or 0/1.
        lam: the GAE lambda.
        chunk_size, cp_group: see :func:`reverse_linear_scan`.
        obs_mask: ``[B, T]`` bool, True on the environment's tokens inside a multi-turn trajectory (never on
            ``response_mask``): the recurrence passes across them (module docstring). None: single-turn.
    """
    if not rewards.shape == values.shape == gates.shape == response_mask.shape:
        raise ValueError("rewards, values, gates and response_mask must have the same [B, T] shape, got "
                         f"{[tuple(t.shape) for t in (rewards, values, gates, response_mask)]}")
    with torch.no_grad():
        # Masking is by selection: masked positions may hold NaN / inf (padding), and NaN * 0 = NaN
        # would spread to every valid token through the scan. Only valid tokens' r, V, kappa are read.
        valid = response_mask.bool()
        m = valid.to(values.dtype)
        vm = torch.where(valid, values, 0.0)
        bridge = None if obs_mask is None else obs_mask.bool() & ~valid
        if bridge is not None:  # an observation passes on the next action token's (V m, m)
            link = bridge.to(values.dtype)
            seen = torch.stack([reverse_linear_scan(x, link, chunk_size=chunk_size, cp_group=cp_group)
                                for x in (vm, m)])
            next_vm, next_m = _next_token(seen, cp_group).unbind(0)
        else:
            next_vm, next_m = _next_token(torch.stack([vm, m]), cp_group).unbind(0)
        # delta at a masked t never reaches a valid token (the transport into it is cut by m_t = 0),
        # so it is set to 0 rather than computed from padding.
        delta = torch.where(valid, rewards + gates * next_vm - vm, 0.0)
        coef = torch.where(valid & (next_m != 0), lam * gates, 0.0)
        if bridge is not None:
            coef = torch.where(bridge, 1.0, coef)
        adv = torch.where(valid, reverse_linear_scan(delta, coef, chunk_size=chunk_size, cp_group=cp_group),
                          0.0)
        return adv, torch.where(valid, adv + values, 0.0)


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *, gamma: float,
        lam: float, chunk_size: int = 128, cp_group: Any = None,
        obs_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: :func:`comp_gae` with every gate equal to ``gamma``."""
    return comp_gae(rewards, values, torch.full_like(values, gamma), response_mask, lam=lam,
                    chunk_size=chunk_size, cp_group=cp_group, obs_mask=obs_mask)


def _next_token(v: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``v[..., t + 1]`` along the (global) sequence, 0 after its end; ``v: [F, B, T]``.

    With ``cp_group`` the local ``T`` holds chunks r and 2cp-1-r; the token after chunk r is the first
    of chunk r+1 (rank r+1's first half, or for r = cp-1 rank cp-1's second half), and the token after
    chunk 2cp-1-r is the first of chunk 2cp-r (rank r-1's second half; nothing for r = 0).
    """
    shifted = torch.nn.functional.pad(v[..., 1:], (0, 1))
    if cp_group is None:
        return shifted
    import torch.distributed as dist

    cp, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    h = v.shape[-1] // 2
    if h == 0 or v.shape[-1] % 2:
        raise ValueError(f"with cp_group the local length must hold two equal chunks, got {v.shape[-1]}")
    firsts = torch.stack([v[..., 0], v[..., h]], dim=-1).contiguous()  # [F, B, 2]
    gathered = [torch.empty_like(firsts) for _ in range(cp)]
    dist.all_gather(gathered, firsts, group=cp_group)
    after_a = gathered[r + 1][..., 0] if r + 1 < cp else gathered[cp - 1][..., 1]
    after_b = gathered[r - 1][..., 1] if r > 0 else torch.zeros_like(after_a)
    shifted[..., h - 1] = after_a
    shifted[..., -1] = after_b
    return shifted
