"""CompPO's critics: the transport-aligned critic (TAC), the standard-critic control, their diagnostics.

Both live on the last pipeline stage and read the actor's features *detached*: the critic has its own
optimizer and its loss never reaches the actor. Outputs are zero-initialised (``V == 0`` at the start, so
Comp-GAE starts from the Monte-Carlo return) and clamped to ``[-value_clamp, value_clamp]``.

TAC (docs/architecture.md "CompPO"), for a response token t of this rank:

    z_t      = sum_l softmax(alpha)_l * x^(l)_t            the last L' layers' outputs, used as they are
                                                           (no extra norm; the last one is the final-norm
                                                           output); alpha = 0 at init: a uniform mix
    q_t      = W_q z_t,  k_i = W_k h_i,  u_i = W_u h_i      proj_dim each; h_i the final hidden state of key
                                                           i of the FULL sequence (``history``)
    r_ti     = sigmoid(<q_t, k_i> / sqrt(proj_dim))         learned relevance of key i to query t
    s_t      = sum_i a_ti r_ti u_i / (sum_i a_ti r_ti + eps)  over the top-K keys i of the final-layer
                                                           attention of t, a_ti their attention weights
    f_t      = tanh(W_l z_t + b_l)                          local features
    V_local  = w_lo . f_t + b_lo                            (zero-initialised)
    V_routed = w_ro . tanh(W_r [s_t; f_t] + b_r) + b_ro     (zero-initialised)
    V_t      = clamp((1 - kappa_t) V_local + kappa_t V_routed, -c, c)

A high gate (concentrated attention: the token's credit is carried by a few earlier tokens) leans on the
routed head, which sees those tokens; a low gate on the local head. The history is projected to proj_dim
*before* the top-K gather, so the largest intermediate is ``[b, s, K, proj_dim]`` (``2 * b*s*K*d`` floats
for keys and values), never ``[b, s, K, H]``.

Two ways to pool over the top-K keys give the same values (up to float rounding), and
:meth:`TransportAlignedCritic.history_summary` takes the cheaper one for the shape:

- gathered (long histories): the K key rows and value rows of each query, ``[b, s, K, d]`` each, then a dot
  product and a weighted sum per query. Its work grows with K alone, but it moves ``2 b s K d`` floats
  through memory, forward and backward.
- dense (``S <= DENSE_KEYS_PER_SLOT * K``): ``<q_t, k_i>`` for every key by one matmul ``[b, s, S]``, the K
  relevances read from it; the weights ``a_ti r_ti`` scattered into a ``[b, s, S]`` matrix that multiplies
  the value rows. Two matmuls forward and four backward, with ``b s S`` floats alive (fewer than the gathered
  path's ``2 b s K d`` while ``S < 2 K d``).

Where this departs from a literal reading of the paper: the value heads are one-hidden-layer tanh MLPs
of width proj_dim (the paper does not give their shape); only their last layers are zero, so ``V == 0``
at init while the gradient reaches those last layers at once and everything else after the first step.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

CRITIC_KINDS = ("tac", "standard")

DENSE_KEYS_PER_SLOT = 32
"""The TAC pools densely while the history has at most this many keys per top-K slot (module docstring).
Measured forward + backward with the projections, one CPU thread, K = 64, proj_dim 64
(``benchmarks/tac_pooling.py``, 2026-12-07, two runs on a shared machine): the gathered pooling takes
3.2-4.4x the dense one's time at S = 8 K, 2.3-2.6x at 16 K, 1.2-1.4x at 32 K and 0.8-1.5x at 64 K. The
dense work grows with S and the gathered work does not: the bound stays below the crossing."""


def _check_inputs(layers, history, topk_idx, topk_w, kappa, num_layers: int | None) -> None:
    if not layers:
        raise ValueError("critic: layers must hold at least one [b, s, H] tensor")
    if num_layers is not None and len(layers) != num_layers:
        raise ValueError(f"critic: got {len(layers)} layers, the critic was built for critic_layers={num_layers}")
    b, s, _ = layers[-1].shape
    if kappa.shape != (b, s):
        raise ValueError(f"critic: kappa {tuple(kappa.shape)} must be [b, s] = {(b, s)}")
    if history is not None:
        if history.shape[0] != b or history.shape[1] < s:
            raise ValueError(f"critic: history {tuple(history.shape)} must be [b, S >= s, H] with b={b}, s={s}")
        if topk_idx.shape[:2] != (b, s) or topk_w.shape != topk_idx.shape:
            raise ValueError(f"critic: topk_idx {tuple(topk_idx.shape)} and topk_w {tuple(topk_w.shape)} "
                             f"must both be [b, s, K] with b={b}, s={s}")


class TransportAlignedCritic(nn.Module):
    """The TAC value head; ``forward`` returns ``V: [b, s]`` float32 (see the module docstring)."""

    def __init__(self, hidden_size: int, *, num_layers: int = 4, proj_dim: int = 64, value_clamp: float = 1.0,
                 dtype: torch.dtype = torch.float32, eps: float = 1e-6):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("critic_layers", num_layers), ("proj_dim", proj_dim)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if value_clamp <= 0:
            raise ValueError(f"value_clamp must be > 0, got {value_clamp}")
        self.num_layers, self.proj_dim, self.value_clamp, self.eps = num_layers, proj_dim, value_clamp, eps
        kw = {"dtype": dtype}
        self.alpha = nn.Parameter(torch.zeros(num_layers, **kw))
        self.w_q = nn.Linear(hidden_size, proj_dim, bias=False, **kw)
        self.w_k = nn.Linear(hidden_size, proj_dim, bias=False, **kw)
        self.w_u = nn.Linear(hidden_size, proj_dim, bias=False, **kw)
        self.local_in = nn.Linear(hidden_size, proj_dim, **kw)
        self.local_out = nn.Linear(proj_dim, 1, **kw)
        self.routed_in = nn.Linear(2 * proj_dim, proj_dim, **kw)
        self.routed_out = nn.Linear(proj_dim, 1, **kw)
        for out in (self.local_out, self.routed_out):  # V == 0 at init; the hidden layers stay random
            nn.init.zeros_(out.weight)
            nn.init.zeros_(out.bias)

    def fuse(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """``z: [b, s, H]``, the softmax(alpha)-weighted sum of the (detached) layer outputs."""
        w = torch.softmax(self.alpha, dim=0)
        dtype = self.alpha.dtype
        return sum(w[i] * x.detach().to(dtype) for i, x in enumerate(layers))

    def history_summary(self, q: torch.Tensor, history: torch.Tensor, topk_idx: torch.Tensor,
                        topk_w: torch.Tensor, *, dense: Optional[bool] = None) -> torch.Tensor:
        """``s: [b, s, d]`` pooled over the top-K keys; ``q: [b, s, d]``, ``history: [b, S, H]``,
        ``topk_idx: [b, s, K]`` global key positions, ``topk_w: [b, s, K]`` (0 marks a padding slot, whose
        index is then ignored). ``dense``: the pooling (module docstring); None: dense while
        ``S <= DENSE_KEYS_PER_SLOT * K``."""
        b, big_s = history.shape[:2]
        d = self.proj_dim
        h = history.detach().to(self.alpha.dtype)
        keys, vals = self.w_k(h), self.w_u(h)  # [b, S, d]: project first, then gather
        w = topk_w.detach().to(self.alpha.dtype)
        idx = torch.where(w > 0, topk_idx, torch.zeros_like(topk_idx))  # a padding slot's index is arbitrary
        if big_s <= DENSE_KEYS_PER_SLOT * idx.shape[-1] if dense is None else dense:
            # Every key's relevance logit by one matmul, the top-K read from it; the pooled weights scattered
            # into [b, s, S] rows that multiply the values. A padding slot (w = 0) adds 0 at index 0. The
            # real slots of a row are distinct keys, so each scatter target takes one value: deterministic
            # on CUDA as on the CPU.
            rel = torch.sigmoid(torch.bmm(q, keys.transpose(1, 2)).gather(-1, idx) / math.sqrt(d))
            a = w * rel  # [b, s, K]
            pooled = torch.bmm(torch.zeros(b, q.shape[1], big_s, dtype=a.dtype, device=a.device).scatter_add(
                -1, idx, a), vals)
            return pooled / (a.sum(-1, keepdim=True) + self.eps)
        # Rows of the flattened [b * S, d] projections looked up as an embedding: the values of advanced
        # indexing keys[rows, idx], and a backward that adds whole rows into each index's row in the index's
        # order, where advanced indexing's accumulates element by element (with atomic adds across CPU
        # threads). The same values and gradients bit for bit (tests/credit/test_gates_and_critic.py); the
        # TAC's forward-backward takes ~0.6x the wall time on two CPU threads (b = 16, s = 1024, K = 64);
        # embedding's backward is deterministic on CUDA as well.
        flat = idx + torch.arange(b, device=idx.device).view(b, 1, 1) * big_s  # [b, s, K] rows of [b * S]
        k_sel = F.embedding(flat, keys.reshape(b * big_s, d))  # [b, s, K, d]
        u_sel = F.embedding(flat, vals.reshape(b * big_s, d))
        rel = torch.sigmoid(torch.einsum("bsd,bskd->bsk", q, k_sel) / math.sqrt(d))
        a = w * rel  # [b, s, K]; padding slots contribute 0 to both sums
        return torch.einsum("bsk,bskd->bsd", a, u_sel) / (a.sum(-1, keepdim=True) + self.eps)

    def forward(self, layers: list[torch.Tensor], history: torch.Tensor, topk_idx: torch.Tensor,
                topk_w: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
        """``layers``: L' tensors ``[b, s, H]`` (last = final-norm output); ``history: [b, S, H]``;
        ``topk_idx``/``topk_w: [b, s, K]``; ``kappa: [b, s]``. Returns ``V: [b, s]`` float32."""
        _check_inputs(layers, history, topk_idx, topk_w, kappa, self.num_layers)
        z = self.fuse(layers)
        summary = self.history_summary(self.w_q(z), history, topk_idx, topk_w)
        f = torch.tanh(self.local_in(z))
        v_local = self.local_out(f).squeeze(-1)
        v_routed = self.routed_out(torch.tanh(self.routed_in(torch.cat([summary, f], dim=-1)))).squeeze(-1)
        g = kappa.detach().to(v_local.dtype)
        v = (1.0 - g) * v_local + g * v_routed
        return v.clamp(-self.value_clamp, self.value_clamp).float()


class StandardCritic(nn.Module):
    """The factorial's control: one zero-initialised Linear on the final hidden state, same clamp.

    Takes TAC's arguments so the trainer calls both alike; uses only ``layers[-1]``."""

    def __init__(self, hidden_size: int, *, value_clamp: float = 1.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        if value_clamp <= 0:
            raise ValueError(f"value_clamp must be > 0, got {value_clamp}")
        self.value_clamp = value_clamp
        self.head = nn.Linear(hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, layers: list[torch.Tensor], history=None, topk_idx=None, topk_w=None,
                kappa: torch.Tensor | None = None) -> torch.Tensor:
        x = layers[-1].detach().to(self.head.weight.dtype)
        return self.head(x).squeeze(-1).clamp(-self.value_clamp, self.value_clamp).float()


def critic_parameter_count(hidden_size: int, *, kind: str = "tac", num_layers: int = 4, proj_dim: int = 64) -> int:
    """Parameters of the critic, from the layer shapes above (no module built).

    >>> critic_parameter_count(2560)
    663814
    >>> critic_parameter_count(2560, kind="standard")
    2561
    """
    h, d = hidden_size, proj_dim
    if kind == "standard":
        return h + 1
    if kind != "tac":
        raise ValueError(f"critic={kind!r}: valid values {list(CRITIC_KINDS)}")
    return (num_layers            # alpha
            + 3 * h * d           # W_q, W_k, W_u
            + (h * d + d)         # local_in
            + (d + 1)             # local_out
            + (2 * d * d + d)     # routed_in
            + (d + 1))            # routed_out


def build_critic(kind: str, hidden_size: int, *, num_layers: int = 4, proj_dim: int = 64, value_clamp: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> nn.Module:
    """``kind`` = ``tac`` or ``standard`` (``algorithm.params.critic``)."""
    if kind == "tac":
        return TransportAlignedCritic(hidden_size, num_layers=num_layers, proj_dim=proj_dim,
                                      value_clamp=value_clamp, dtype=dtype)
    if kind == "standard":
        return StandardCritic(hidden_size, value_clamp=value_clamp, dtype=dtype)
    raise ValueError(f"critic={kind!r}: valid values {list(CRITIC_KINDS)}")


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of the 1-D ``x``; tied values share the mean of their ranks.

    >>> average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0]))
    tensor([3.5000, 1.0000, 3.5000, 2.0000], dtype=torch.float64)
    """
    sorted_x, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts  # 0-based position of each tie group's first element
    group_rank = start.double() + (counts.double() + 1.0) / 2.0
    ranks = torch.empty_like(group_rank[inverse])
    ranks[order] = group_rank[inverse]
    return ranks


def _pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    xc, yc = x - x.mean(), y - y.mean()
    denom = torch.sqrt((xc * xc).sum() * (yc * yc).sum())
    return torch.where(denom > 0, (xc * yc).sum() / denom.clamp(min=torch.finfo(x.dtype).tiny),
                       torch.full_like(denom, float("nan")))


def critic_diagnostics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       value_clamp: float) -> dict[str, torch.Tensor]:
    """Detached float64 scalars over the valid tokens of ``values, returns, mask: [B, T]``.

    - ``explained_var``: ``1 - Var(R - V) / Var(R)`` (population variances; NaN when ``Var(R) == 0``);
    - ``spearman``: Pearson correlation of the average ranks of V and R (NaN when either is constant);
    - ``value_mae``: mean ``|V - R|``;
    - ``clamp_frac``: share of tokens with ``|V| >= value_clamp - 1e-6`` (the critic saturating).

    These are local statistics (rank order does not reduce over DP): pass gathered tensors for global ones.

    >>> v = torch.tensor([[0.0, 0.5, 1.0]]); r = torch.tensor([[0.0, 1.0, 2.0]])
    >>> d = critic_diagnostics(v, r, torch.ones(1, 3, dtype=torch.bool), value_clamp=1.0)
    >>> [round(float(d[k]), 4) for k in ("explained_var", "spearman", "value_mae", "clamp_frac")]
    [0.75, 1.0, 0.5, 0.3333]
    """
    m = mask.bool()
    v = values.detach()[m].double()
    r = returns.detach()[m].double()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=v.device)
    if v.numel() == 0:
        return {"explained_var": nan, "spearman": nan, "value_mae": nan, "clamp_frac": nan}
    var_r = r.var(unbiased=False)
    ev = torch.where(var_r > 0, 1.0 - (r - v).var(unbiased=False) / var_r.clamp(min=torch.finfo(r.dtype).tiny), nan)
    return {
        "explained_var": ev,
        "spearman": _pearson(average_ranks(v), average_ranks(r)),
        "value_mae": (v - r).abs().mean(),
        "clamp_frac": (v.abs() >= value_clamp - 1e-6).double().mean(),
    }
