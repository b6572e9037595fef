"""The transport-aligned critic's two poolings over its top-K keys, as ratios: gathered against dense.

``TransportAlignedCritic.history_summary`` pools a query over its top-K keys either by gathering the K key
and value rows (work set by K) or by one matmul with every key of the history and a scatter of the K weights
(work set by the history's length S); it takes the dense one while ``S <= DENSE_KEYS_PER_SLOT * K``
(``megatron_credit/models/critic.py``). This prints the forward + backward time of each at S = 8 K, 16 K,
32 K and 64 K (one sequence whose S queries each read K distinct earlier keys), and their ratio, which is
what the bound rests on. One thread by default, so the ratio does not depend on the machine's load.

    python benchmarks/tac_pooling.py [--k 64] [--proj-dim 64] [--repeats 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--proj-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from megatron_credit.models.critic import DENSE_KEYS_PER_SLOT, TransportAlignedCritic

    k = args.k
    critic = TransportAlignedCritic(args.hidden, num_layers=1, proj_dim=args.proj_dim)
    print(f"K = {k}, proj_dim {args.proj_dim}, hidden {args.hidden}, {args.threads} thread(s), median of "
          f"{args.repeats}; the default pools densely up to S = {DENSE_KEYS_PER_SLOT * k}")
    g = torch.Generator().manual_seed(0)
    for per_slot in (8, 16, 32, 64):
        s = per_slot * k
        history = torch.randn(1, s, args.hidden, generator=g)
        q = torch.randn(1, s, args.proj_dim, generator=g)
        # query t reads K distinct keys among 0..max(t, K - 1) (a real top-K is distinct and causal)
        scores = torch.rand(s, s, generator=g).masked_fill(
            torch.arange(s)[None, :] > torch.arange(s).clamp(min=k - 1)[:, None], -1.0)
        idx = scores.topk(k, dim=-1).indices[None]
        w = torch.rand(1, s, k, generator=g)
        times = {True: [], False: []}
        for rep in range(args.repeats + 1):
            for dense in (True, False):
                qq = q.clone().requires_grad_()
                t0 = time.perf_counter()
                critic.history_summary(qq, history, idx, w, dense=dense).square().sum().backward()
                if rep:  # the first round warms up
                    times[dense].append(time.perf_counter() - t0)
        d, gth = statistics.median(times[True]), statistics.median(times[False])
        print(f"S = {s:6d} ({per_slot:2d} K): dense {d:.4f}s, gathered {gth:.4f}s, gathered / dense = {gth / d:.2f}")


if __name__ == "__main__":
    main()
