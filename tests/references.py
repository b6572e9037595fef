"""The float64 references of the math: loops (one position, token or response at a time) or, for attention, a
materialised softmax, written from docs/architecture.md's formulas and independently of ``megatron_credit``'s code.
Every test of the credit and loss math compares against these, so each formula has one reference.

- :func:`scan_reference`: the reverse linear recurrence ``y_t = x_t + a_t y_{t+1}``;
- :func:`gae_reference` (textbook GAE, by runs of valid tokens), :func:`comp_gae_reference` (Comp-GAE),
  :func:`comppo_gate_reference` (CompPO's gate ``kappa``);
- :func:`group_advantages_reference` (GRPO, Dr.GRPO, RLOO);
- :func:`future_kl_reference` (FIPO's discounted future KL), :func:`fipo_weights_reference`;
- :func:`ppo_reference` (PPO clip with dual clip and IS weights: loss and gradient), :func:`gspo_reference`,
  :func:`aggregate_reference` (the loss aggregation modes);
- :func:`logprob_entropy_reference` (log-probs and entropies of temperature-scaled logits);
- :func:`dense_attention` (a materialised causal softmax), :func:`dense_concentration`, :func:`dense_topk`
  (CompPO's attention statistics from it);
- :func:`qkv_reference` (megatron's fused QKV row order, row by row);
- :func:`credit_diagnostics_reference` (Gini, effective token fraction and position correlation of |A|,
  by pairs of tokens, one response at a time);
- :func:`lora_linear_reference` (a linear with a LoRA update, one output at a time).
"""
import math

import torch


def scan_reference(x, a):
    """y_t = x_t + a_t y_{t+1}, y_T = 0, one position at a time in float64."""
    x, a = x.double(), (a.double() if isinstance(a, torch.Tensor) else torch.full(x.shape, a, dtype=torch.float64))
    y = torch.zeros_like(x)
    nxt = torch.zeros(x.shape[0], dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        nxt = x[:, t] + a[:, t] * nxt
        y[:, t] = nxt
    return y


def gae_reference(r, v, mask, gamma, lam):
    """Textbook GAE per response, written independently of Comp-GAE: for each maximal run of valid
    tokens [s, e), delta_t = r_t + gamma V_{t+1} [t+1 < e] - V_t and A_t = sum_l (gamma lam)^l delta_{t+l}
    within the run."""
    b, t = r.shape
    adv = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        s = 0
        while s < t:
            if not mask[i, s]:
                s += 1
                continue
            e = s
            while e < t and mask[i, e]:
                e += 1
            delta = [float(r[i, u]) + (gamma * float(v[i, u + 1]) if u + 1 < e else 0.0) - float(v[i, u])
                     for u in range(s, e)]
            for u in range(s, e):
                adv[i, u] = sum((gamma * lam) ** (w - u) * delta[w - s] for w in range(u, e))
            s = e
    m = mask.double()
    return adv, (adv + v) * m


def comp_gae_reference(r, v, kappa, mask, lam):
    """delta_t = r_t + k_t V_{t+1} m_{t+1} - V_t m_t;  A_t = delta_t + lam k_t A_{t+1} m_{t+1}."""
    b, t = r.shape
    m = mask.double()
    adv = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        nxt_a, nxt_v, nxt_m = 0.0, 0.0, 0.0
        for s in reversed(range(t)):
            delta = r[i, s] + kappa[i, s] * nxt_v * nxt_m - v[i, s] * m[i, s]
            a = delta + lam * kappa[i, s] * nxt_a * nxt_m
            adv[i, s] = a
            nxt_a, nxt_v, nxt_m = a, v[i, s], m[i, s]
    return adv * m, (adv + v) * m


def comppo_gate_reference(h, n, *, k_lo, k_hi, tau):
    """kappa = k_lo + (k_hi - k_lo) sigmoid(tau (c - 1/2)), c = (H - 1/n) / (1 - 1/n) (c = 1 when n <= 1),
    one position at a time."""
    out = torch.empty_like(h)
    for i in range(h.numel()):
        nv = int(n[i])
        c = 1.0 if nv <= 1 else (float(h[i]) - 1 / nv) / (1 - 1 / nv)
        out[i] = k_lo + (k_hi - k_lo) / (1 + math.exp(-tau * (c - 0.5)))
    return out


def group_advantages_reference(scores, ids, kind, eps=1e-6):
    """Per response, from its group's members by loops: GRPO ``(s - mean) / (unbiased std + eps)``, Dr.GRPO
    ``s - mean``, RLOO ``s - mean of the others`` (``kind``: grpo, dr_grpo, rloo); 0 for a group of one."""
    out = torch.zeros_like(scores)
    for i in range(len(scores)):
        members = [float(scores[j]) for j in range(len(scores)) if ids[j] == ids[i]]
        n = len(members)
        if n == 1:
            continue
        mean = sum(members) / n
        if kind == "grpo":
            std = (sum((x - mean) ** 2 for x in members) / (n - 1)) ** 0.5
            out[i] = (float(scores[i]) - mean) / (std + eps)
        elif kind == "dr_grpo":
            out[i] = float(scores[i]) - mean
        else:
            out[i] = float(scores[i]) - (sum(members) - float(scores[i])) / (n - 1)
    return out


def future_kl_reference(logp, old, mask, *, tau, c, packed):
    """F_t = sum_{k >= t} gamma^(k-t) m_k [d_k <= log c] d_k, d = clamp(logp - old, -20, 20), gamma = 2^(-1/tau);
    with ``packed`` the sum stops at the first masked token (the end of a packed response)."""
    d = (logp - old).clamp(-20, 20)
    keep = (d <= math.log(c)).double()
    m = mask.double()
    gamma = 2.0 ** (-1.0 / tau)
    b, t = d.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for s in range(t):
            if not mask[i, s]:
                continue
            acc = 0.0
            for k in range(s, t):
                if packed and not mask[i, k]:
                    break  # end of this packed response
                acc += keep[i, k] * m[i, k] * gamma ** (k - s) * d[i, k]
            out[i, s] = acc
    return out


def fipo_weights_reference(logp, old, adv, mask, *, tau, clip, c, safety=None, packed=False):
    """docs/architecture.md "FIPO" one token at a time: clamp(exp(F), lo, hi), then min(f, 1) where A < 0 and
    ratio > safety (``None``: c); 1 on masked tokens."""
    f = future_kl_reference(logp, old, mask, tau=tau, c=c, packed=packed)
    s = c if safety is None else safety
    w = torch.ones_like(f)
    for i, t in mask.nonzero().tolist():
        v = min(max(math.exp(f[i, t]), clip[0]), clip[1])
        if adv[i, t] < 0 and math.exp(min(max(float(logp[i, t] - old[i, t]), -20), 20)) > s:
            v = min(v, 1.0)
        w[i, t] = v
    return w


def ppo_reference(logp, old, adv, mask, *, el, eh, c, isw=None):
    """Per-token loss and d loss / d logp from the formulas, one token at a time."""
    b, t = logp.shape
    loss, grad = torch.zeros(b, t, dtype=torch.float64), torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for s in range(t):
            if not mask[i, s]:
                continue
            a = float(adv[i, s])
            r = math.exp(min(max(float(logp[i, s] - old[i, s]), -20), 20))
            unclipped, clipped = -a * r, -a * min(max(r, 1 - el), 1 + eh)
            val, g = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if c is not None and a < 0 and -a * c < val:
                val, g = -a * c, 0.0
            wgt = 1.0 if isw is None else float(isw[i, s])
            loss[i, s], grad[i, s] = val * wgt, g * wgt
    return loss, grad


def gspo_reference(logp, old, adv, mask, *, el, eh):
    """Per-token value of GSPO-token: each valid token carries its row's sequence loss."""
    out = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        lr = sum(float(logp[i, t] - old[i, t]) for t in range(logp.shape[1]) if mask[i, t]) / n
        s = math.exp(min(max(lr, -20.0), 20.0))
        for t in range(logp.shape[1]):
            if mask[i, t]:
                a = float(adv[i, t])
                out[i, t] = max(-a * s, -a * min(max(s, 1 - el), 1 + eh))
    return out


def aggregate_reference(l, mask, mode, n_tok, n_seq, length):
    """The aggregated loss of every mode, one response at a time over global denominators ``n_tok`` tokens,
    ``n_seq`` responses, ``length`` (seq-mean-token-sum-norm)."""
    total = 0.0
    for i in range(l.shape[0]):
        seq = sum(float(l[i, t]) for t in range(l.shape[1]) if mask[i, t])
        cnt = int(mask[i].sum())
        if mode == "token-mean":
            total += seq / n_tok
        elif mode == "seq-mean-token-sum":
            total += seq / n_seq
        elif mode == "seq-mean-token-mean":
            total += (seq / cnt if cnt else 0.0) / n_seq
        else:
            total += seq / (n_seq * length)
    return total


def logprob_entropy_reference(logits, labels, temperature=1.0):
    """Loop over tokens: logp = log_softmax(z)[y], H = -sum p log p, z = logits / temperature."""
    batch, seq, _ = logits.shape
    logp, ent = [], []
    for b in range(batch):
        for t in range(seq):
            ls = torch.log_softmax(logits[b, t] / temperature, dim=-1)
            logp.append(ls[labels[b, t]])
            ent.append(-(ls.exp() * ls).sum())
    return torch.stack(logp).view(batch, seq), torch.stack(ent).view(batch, seq)


def dense_attention(query, key, *, scale=None, q_positions=None):
    """``a [B, Hq, Tq, Tk]`` float64: materialised causal softmax, GQA by repeating K (reference only)."""
    q, k = query.double(), key.double()
    tq, tk = q.shape[2], k.shape[2]
    pos = torch.arange(tk - tq, tk) if q_positions is None else q_positions
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s.masked_fill(torch.arange(tk)[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)


def dense_concentration(query, key, **kw):
    """``(H [B, Tq], n [B, Tq])``: the head-mean of sum_i a_i**2 over the dense attention, and the visible keys."""
    a = dense_attention(query, key, **kw)
    return (a * a).sum(-1).mean(1), (a > 0).sum(-1)[:, 0]


def dense_topk(query, key, k, **kw):
    """The top-``k`` of the head-mean dense attention ``[B, Tq, Tk]`` (values, indices), and that attention."""
    a = dense_attention(query, key, **kw).mean(1)  # [B, Tq, Tk]
    return torch.topk(a, min(k, a.shape[-1]), dim=-1), a


def qkv_reference(q, k, v, heads, groups, d):
    """Row-by-row loop: for each group g, its q heads, then k head g, then v head g."""
    rows = []
    per = heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows += [q[h * d + j] for j in range(d)]
        rows += [k[g * d + j] for j in range(d)]
        rows += [v[g * d + j] for j in range(d)]
    return torch.stack(rows)


def credit_diagnostics_reference(adv, mask):
    """Per response with credit (docs/credit_maps.md): the Gini coefficient of x = |A| over the valid tokens
    from all pairs, sum |x_i - x_j| / (2 L sum x); (sum x)^2 / sum x^2 / L; Pearson's correlation of x with
    the index 0..L-1 (0 when x or the index is constant). None for a response without credit."""
    out = []
    for a, m in zip(adv.double().tolist(), mask.bool().tolist()):
        x = [abs(v) for v, keep in zip(a, m) if keep]
        n, s = len(x), sum(x)
        if s == 0:
            out.append(None)
            continue
        gini = sum(abs(xi - xj) for xi in x for xj in x) / (2 * n * s)
        eff = s * s / sum(v * v for v in x) / n
        mx, mp = s / n, (n - 1) / 2
        cov = sum((v - mx) * (i - mp) for i, v in enumerate(x))
        vx, vp = sum((v - mx) ** 2 for v in x), sum((i - mp) ** 2 for i in range(n))
        corr = 0.0 if vx <= 1e-20 * sum(v * v for v in x) * n or vp == 0 else cov / math.sqrt(vx * vp)
        out.append({"gini": gini, "effective_frac": eff, "position_corr": corr})
    return out


def without_observations(estimator, mask, obs, *tensors):
    """The multi-turn definition (docs/multi_turn.md) by its plain statement: each row's trajectory with its
    observations taken out, its action tokens side by side (the single-turn sequence they make), the
    single-turn reference ``estimator(*row_tensors, row_mask)`` run on that, and each output put back at
    the action tokens (0 elsewhere). ``obs`` only checks that observations are never actions; a row holds
    one trajectory."""
    assert not (mask.bool() & obs.bool()).any()
    b, t = mask.shape
    outs = None
    for i in range(b):
        idx = mask[i].nonzero().flatten()
        if not len(idx):
            continue
        got = estimator(*[x[i:i + 1, idx] for x in tensors], torch.ones(1, len(idx), dtype=torch.bool))
        got = got if isinstance(got, tuple) else (got,)
        if outs is None:
            outs = [torch.zeros(b, t, dtype=torch.float64) for _ in got]
        for o, g in zip(outs, got):
            o[i, idx] = g[0].double()
    if outs is None:
        return torch.zeros(b, t, dtype=torch.float64)
    return tuple(outs) if len(outs) > 1 else outs[0]


def lora_linear_reference(x, w, a, b, scale, bias=None):
    """``y[t, o] = sum_i x[t, i] w[o, i] + scale * sum_j (sum_i x[t, i] a[j, i]) b[o, j] (+ bias[o])`` over
    the rows ``t`` of ``x`` (any leading shape), one output at a time, in float64."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    w, a, b = w.double(), a.double(), b.double()
    out = torch.zeros(x2.shape[0], w.shape[0], dtype=torch.float64)
    for t in range(x2.shape[0]):
        xa = [float((x2[t] * a[j]).sum()) for j in range(a.shape[0])]
        for o in range(w.shape[0]):
            low = sum(xa[j] * float(b[o, j]) for j in range(a.shape[0]))
            out[t, o] = float((x2[t] * w[o]).sum()) + scale * low + (float(bias[o]) if bias is not None else 0.0)
    return out.reshape(*x.shape[:-1], w.shape[0])


def engine_trainer_logprobs(seed=0, b=5, t=9):
    """Random float64 log-probs of an engine and of the trainer near it, ``[b, t]``, and a mask whose last
    row is empty: the inputs of the mismatch metrics and the truncated importance weights."""
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    trainer = engine + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[-1] = False  # an empty sequence
    return engine, trainer, mask
