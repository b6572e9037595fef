"""Peak memory and time of log-probs + entropy (forward + backward): chunked vs unchunked, on CPU.

Each measurement runs in a fresh subprocess: it allocates the bf16 logits ``[1, T, V]`` and labels,
reads ``ru_maxrss`` as the baseline, runs forward + backward once, and reports ``ru_maxrss - baseline``
(the peak of everything the computation allocated, including the bf16 logits gradient, which every
variant must produce). ``tracemalloc`` cannot see torch's allocations; RSS can. Time is the process's
CPU time on one thread, the better of two runs, so that other jobs on shared cores distort it less.

Variants:
    chunked  ``logprobs_and_entropy(..., chunk_size=C)``: one fp32 chunk at a time
    fused    the same function with ``chunk_size=T`` (fused math, but the whole sequence upcast at once)
    naive    ``log_softmax(logits.float())``, gather, ``-(p * log p).sum()`` and autograd

The naive computation at V=152,064 x T=8,192 needs more than 20 GB, more than this machine can spare,
so it is measured at two smaller T and extrapolated linearly (its memory is exactly linear in T); the
table marks extrapolated rows. Usage::

    python benchmarks/logprob_memory.py [--vocab 152064] [--tokens 8192] [--small 1024 2048] [--chunk 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _worker(variant: str, tokens: int, vocab: int, chunk: int) -> dict:
    import torch

    # One thread: CPU time then measures work, not OpenMP workers spinning between the chunk loop's ops.
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from megatron_credit.losses.logprob import logprobs_and_entropy

    torch.manual_seed(0)
    logits = torch.empty(1, tokens, vocab, dtype=torch.bfloat16)
    for s in range(0, tokens, 64):  # filled in small pieces so no fp32 copy inflates the baseline
        logits[0, s:s + 64] = torch.randn(min(64, tokens - s), vocab).mul_(2)
    logits.requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    baseline = _maxrss_bytes()

    def run() -> float:
        start = time.process_time()  # CPU time of this process: robust to other jobs on shared cores
        if variant == "naive":
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
        else:
            logp, ent = logprobs_and_entropy(logits, labels,
                                             chunk_size=chunk if variant == "chunked" else tokens)
        (logp.sum() + ent.sum()).backward()
        return time.process_time() - start

    first = run()
    peak = _maxrss_bytes() - baseline  # read before the timing repeat (which allocates the same again)
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    logits.grad = None
    return {"peak_bytes": peak, "seconds": min(first, run())}


def _measure(variant: str, tokens: int, vocab: int, chunk: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--tokens", str(tokens),
           "--vocab", str(vocab), "--chunk", str(chunk)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _extrapolate(points: list[tuple[int, dict]], tokens: int) -> dict:
    """Linear fit through the two (T, value) points, evaluated at ``tokens``."""
    (t0, a), (t1, b) = points
    line = lambda k: a[k] + (b[k] - a[k]) * (tokens - t0) / (t1 - t0)  # noqa: E731
    return {"peak_bytes": line("peak_bytes"), "seconds": line("seconds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--small", type=int, nargs=2, default=[1024, 2048],
                   help="two sequence lengths at which the unchunked variants are measured")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--worker", choices=["chunked", "fused", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.tokens, args.vocab, args.chunk)))
        return

    gib = 2 ** 30
    rows = []  # (variant, T, result, how)
    small = {v: [(t, _measure(v, t, args.vocab, args.chunk)) for t in args.small]
             for v in ("naive", "fused", "chunked")}
    for v, pts in small.items():
        rows += [(v, t, r, "measured") for t, r in pts]
    big_chunked = _measure("chunked", args.tokens, args.vocab, args.chunk)
    rows.append(("chunked", args.tokens, big_chunked, "measured"))
    big = {v: _extrapolate(small[v], args.tokens) for v in ("naive", "fused")}
    rows += [(v, args.tokens, big[v], "extrapolated") for v in ("naive", "fused")]

    print(f"log-probs + entropy, forward + backward, V={args.vocab}, bf16 logits, chunk={args.chunk}, "
          f"1 CPU thread; peak = ru_maxrss above the inputs (bf16 logits: "
          f"{args.tokens * args.vocab * 2 / gib:.2f} GiB at T={args.tokens})")
    print(f"{'variant':<9} {'T':>6} {'peak GiB':>9} {'x logits':>9} {'cpu s':>8}  how")
    for v, t, r, how in rows:
        logits_bytes = t * args.vocab * 2
        print(f"{v:<9} {t:>6} {r['peak_bytes'] / gib:>9.2f} {r['peak_bytes'] / logits_bytes:>9.2f} "
              f"{r['seconds']:>8.2f}  {how}")
    t_small = args.small[1]
    same_t = dict(small["chunked"])[t_small], dict(small["naive"])[t_small]
    print(f"\nT={args.tokens}: peak memory chunked / naive (unchunked, extrapolated) = "
          f"{big_chunked['peak_bytes'] / big['naive']['peak_bytes']:.3f}; "
          f"chunked / fused-unchunked (extrapolated) = "
          f"{big_chunked['peak_bytes'] / big['fused']['peak_bytes']:.3f}")
    print(f"T={args.tokens}: forward+backward CPU time chunked / naive (extrapolated) = "
          f"{big_chunked['seconds'] / big['naive']['seconds']:.3f}")
    print(f"T={t_small} (both measured): peak memory chunked / naive = "
          f"{same_t[0]['peak_bytes'] / same_t[1]['peak_bytes']:.3f}; CPU time chunked / naive = "
          f"{same_t[0]['seconds'] / same_t[1]['seconds']:.3f}")


if __name__ == "__main__":
    main()
