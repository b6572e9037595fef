"""Ratio benchmark of FIPO's Future-KL on CPU: our chunked scan vs the published algorithm vs cumsum.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/credit_kernels.py [--threads 1] [--lengths ...]
        [--no-memory]

At B = 8, float32, for each T it prints the best-of-runs time of

- ``ours``: :func:`megatron_credit.credit.future_kl.future_kl` (tau = 32, c = 10) as users call it, with
  the default ``chunk_size=128``; on CPU the constant-decay path caps K at
  ``scan.CPU_CONSTANT_CHUNK = 32`` (a [*, 32] x [32, 32] Toeplitz block: 4x fewer flops than K = 128);
- ``ours128``: the same with the cap lifted, i.e. K = 128 as on CUDA (for comparison);
- ``published``: the published FIPO algorithm, reimplemented from its description: for each key chunk
  of K = 128 columns, a (T x K) decay matrix ``gamma**(k - t)`` and a matmul (O(B*T**2));
- ``cumsum``: one ``torch.cumsum`` over a [B, T] tensor, the memory-bandwidth floor of any scan;

the ratios, and the peak extra memory of each (resident-set high-water mark above the inputs during a second
run, in a fresh subprocess per kernel, with ``/proc/self/clear_refs``; Linux only). Targets, at
T = 20480: >= 20x faster than published, <= 4x the cumsum floor, extra memory <= 2x the input; a final
block says which configuration meets which target. The machine may be shared: times are best-of-N.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_credit.credit import scan  # noqa: E402
from megatron_credit.credit.future_kl import future_kl  # noqa: E402

B, TAU, C, K = 8, 32.0, 10.0, 128


def published_future_kl(logp, old_logp, mask, *, tau=TAU, c=C, k=K):
    """The published algorithm: per key chunk, a (T x K) decay matrix and a matmul."""
    d = (logp - old_logp).clamp(-20, 20)
    x = torch.where(d <= math.log(c), d, torch.zeros_like(d)) * mask
    gamma = 2.0 ** (-1.0 / tau)
    t = x.shape[1]
    rows = torch.arange(t, dtype=x.dtype)
    out = torch.zeros_like(x)
    for k0 in range(0, t, k):
        cols = torch.arange(k0, min(k0 + k, t), dtype=x.dtype)
        diff = cols[None, :] - rows[:, None]                      # [T, K]: k - t
        decay = torch.where(diff >= 0, gamma ** diff.clamp(min=0), torch.zeros_like(diff))
        out += x[:, k0:k0 + k] @ decay.T
    return out * mask


def make_inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, t, generator=g) * 3
    old = logp - 0.3 * torch.randn(B, t, generator=g)
    lengths = torch.randint(t // 2, t + 1, (B,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, mask


def _ours_k128(logp, old, mask):
    """future_kl with the CPU cap on the constant path's K lifted: K = 128, as on CUDA."""
    cap = scan.CPU_CONSTANT_CHUNK
    scan.CPU_CONSTANT_CHUNK = K
    try:
        return future_kl(logp, old, mask, tau=TAU, dual_clip_c=C, chunk_size=K)
    finally:
        scan.CPU_CONSTANT_CHUNK = cap


def kernels(logp, old, mask):
    x = logp - old
    return {
        "ours": lambda: future_kl(logp, old, mask, tau=TAU, dual_clip_c=C),
        "ours_k128": lambda: _ours_k128(logp, old, mask),
        "published": lambda: published_future_kl(logp, old, mask),
        "cumsum": lambda: torch.cumsum(x, dim=1),
    }


def best_ms(fn, budget_s=2.0, max_reps=50):
    """Best of repeated runs: on a shared machine the minimum is the least noisy estimate."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def peak_extra_bytes(name, t):
    """Peak resident memory above the inputs while one kernel runs, in bytes.

    A fresh process runs the kernel once to page in library code (BLAS kernels are megabytes of code),
    resets the high-water mark, and runs it again. ``MALLOC_MMAP_THRESHOLD_`` makes every large buffer
    its own mapping, returned to the OS when freed, so the resident set follows live tensors.
    """
    code = (f"import torch, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
            f"import credit_kernels as ck; torch.set_num_threads(1);"
            f"a = ck.make_inputs({t}); fn = ck.kernels(*a)[{name!r}];"
            f"out = fn(); del out;"
            f"open('/proc/self/clear_refs', 'w').write('5'); base = ck._rss_kib('VmRSS');"
            f"out = fn(); print((ck._rss_kib('VmHWM') - base) * 1024)")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return int(res.stdout.strip().splitlines()[-1])


TARGETS = {"publ/ours >= 20x": lambda r: r["speedup"] >= 20, "ours/cumsum <= 4x": lambda r: r["floor"] <= 4,
           "extra memory <= 2x input": lambda r: r["mem"] <= 2}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 20480])
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"future_kl, B={B}, float32, CPU, {args.threads} thread(s), tau={TAU}, published K={K}; "
          f"ours = default call (chunk_size=128, constant path K={scan.CPU_CONSTANT_CHUNK} on CPU), "
          f"ours128 = K=128 forced; best of up to 50 runs")
    print(f"{'T':>6} {'ours ms':>8} {'ours128 ms':>10} {'publ. ms':>9} {'cumsum ms':>9} {'publ/ours':>9}"
          f" {'publ/ours128':>12} {'ours/cumsum':>11} {'ours128/cumsum':>14} | extra memory / input: "
          f"{'ours':>5} {'ours128':>7} {'publ.':>6} {'cumsum':>6}")
    summary = {}
    for t in args.lengths:
        inputs = make_inputs(t)
        ks = kernels(*inputs)
        ref = ks["published"]()
        for name in ("ours", "ours_k128"):  # same numbers first
            torch.testing.assert_close(ks[name](), ref, rtol=1e-4, atol=1e-4)
        ms = {name: best_ms(fn) for name, fn in ks.items()}
        in_bytes = sum(x.numel() * x.element_size() for x in inputs)
        mem = {n: float("nan") if args.no_memory else peak_extra_bytes(n, t) / in_bytes for n in ks}
        for name in ("ours", "ours_k128"):
            summary[(name, t)] = {"speedup": ms["published"] / ms[name], "floor": ms[name] / ms["cumsum"],
                                  "mem": mem[name]}
        print(f"{t:>6} {ms['ours']:>8.2f} {ms['ours_k128']:>10.2f} {ms['published']:>9.1f} {ms['cumsum']:>9.2f} "
              f"{ms['published'] / ms['ours']:>8.0f}x {ms['published'] / ms['ours_k128']:>11.0f}x "
              f"{ms['ours'] / ms['cumsum']:>10.2f}x {ms['ours_k128'] / ms['cumsum']:>13.2f}x | {'':>21}"
              f"{mem['ours']:>5.2f}x {mem['ours_k128']:>6.2f}x {mem['published']:>5.1f}x {mem['cumsum']:>5.2f}x",
              flush=True)
    print("extra memory is the peak above the inputs, as a multiple of the input bytes "
          "(logp, old_logp: float32; mask: bool)")
    print("targets (stated at T = 20480; other lengths for information):")
    for (name, t), r in summary.items():
        verdict = ", ".join(f"{label}: {'MET' if ok(r) else 'MISSED'}" for label, ok in TARGETS.items()
                            if not (label.startswith("extra") and math.isnan(r["mem"])))
        label = "ours (default)" if name == "ours" else "ours128 (K=128)"
        print(f"  {label:<16} T={t:>6}: {verdict}")


if __name__ == "__main__":
    main()
