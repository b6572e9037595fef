"""Token-budget micro-batching, shared by the old-log-prob pass and the update.

``make_microbatches`` turns response+prompt lengths into lists of sample indices whose token cost fits
``max_tokens_per_microbatch``. It is a pure, deterministic function of the lengths, so the trainer
computes the split once per mini-batch (``plan_minibatches``) and runs *both* the old-log-prob forward
and the update over exactly the same micro-batches: same padding, same kernels, same reduction order,
hence ``logp == old_logp`` bit-for-bit on the first on-policy mini-batch (docs/architecture.md).

Cost of a micro-batch (``mode``):

- ``"padded"``: ``len(mb) * max(round_up(len_i))`` tokens: the [b, T] tensor a padded forward builds.
- ``"packed"``: ``sum(round_up(len_i))`` tokens: one THD-packed sequence; ``round_up`` to
  ``pad_to_multiple_of`` (e.g. 2·cp·tp for context parallelism) is the per-sequence padding packing adds.

Algorithm: samples sorted by length (longest first, ties by index); "padded" fills micro-batches
greedily in that order (the first sample of each is its longest, so the cost is known while filling);
"packed" is first-fit decreasing. A sample longer than the budget on its own gets a micro-batch of its
own (it is never split or dropped); ``oversized`` in ``microbatch_stats`` counts them.

Megatron's pipeline schedule needs the same number of micro-batches on every DP rank.
``min_num_microbatches`` splits the most populated micro-batches until there are at least that many
(a split can only lower a cost); the trainer computes each rank's count, takes the max over the DP group
(``max_count_across_ranks``), and re-plans with it.

>>> make_microbatches([5, 3, 8, 2], max_tokens_per_microbatch=10)
[[2], [0, 1], [3]]
>>> make_microbatches([5, 3, 8, 2], max_tokens_per_microbatch=10, mode="packed")
[[2, 3], [0, 1]]
>>> make_microbatches([5, 3, 8, 2], max_tokens_per_microbatch=10, mode="packed", min_num_microbatches=3)
[[2], [3], [0, 1]]
"""
from __future__ import annotations

from typing import Literal, Sequence

Mode = Literal["padded", "packed"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_cost(
    seq_lens: Sequence[int], mb: Sequence[int], *, mode: Mode, pad_to_multiple_of: int = 1
) -> int:
    """Token cost of micro-batch ``mb`` (indices into ``seq_lens``) under ``mode``."""
    lens = [_round_up(int(seq_lens[i]), pad_to_multiple_of) for i in mb]
    return len(lens) * max(lens, default=0) if mode == "padded" else sum(lens)


def make_microbatches(
    seq_lens: Sequence[int], *, max_tokens_per_microbatch: int, mode: Mode = "padded",
    pad_to_multiple_of: int = 1, min_num_microbatches: int = 1,
) -> list[list[int]]:
    """Index lists (ascending within each) covering ``range(len(seq_lens))`` once; see module doc.

    ``seq_lens`` may be a sequence of ints or a 1-D integer tensor (converted to a list on entry).
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if mode not in ("padded", "packed"):
        raise ValueError(f"mode must be 'padded' or 'packed', got {mode!r}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    # A list of ints on entry: a tensor's truth value is ambiguous and its elements are 0-d tensors.
    seq_lens = [int(n) for n in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)]
    if any(n < 0 for n in seq_lens):
        raise ValueError("seq_lens must be non-negative")
    if min_num_microbatches > max(len(seq_lens), 1):
        raise ValueError(
            f"min_num_microbatches={min_num_microbatches} exceeds the {len(seq_lens)} sequences: a "
            "micro-batch cannot be empty; use fewer micro-batches (or more samples per rank)"
        )
    if not seq_lens:
        return []
    size = [_round_up(int(n), pad_to_multiple_of) for n in seq_lens]
    order = sorted(range(len(size)), key=lambda i: (-size[i], i))
    budget = max_tokens_per_microbatch
    mbs: list[list[int]] = []
    if mode == "padded":
        for i in order:
            if mbs and (len(mbs[-1]) + 1) * size[mbs[-1][0]] <= budget:
                mbs[-1].append(i)
            else:
                mbs.append([i])
    else:
        loads: list[int] = []
        for i in order:
            for k, load in enumerate(loads):
                if load + size[i] <= budget:
                    mbs[k].append(i)
                    loads[k] += size[i]
                    break
            else:
                mbs.append([i])
                loads.append(size[i])
    while len(mbs) < min_num_microbatches:
        k = max(range(len(mbs)), key=lambda j: (len(mbs[j]), -j))  # most samples, earliest on ties
        half = len(mbs[k]) // 2
        mbs[k : k + 1] = [mbs[k][:half], mbs[k][half:]]
    return [sorted(mb) for mb in mbs]


def microbatch_stats(
    seq_lens: Sequence[int], mbs: Sequence[Sequence[int]], *, max_tokens_per_microbatch: int,
    mode: Mode = "padded", pad_to_multiple_of: int = 1,
) -> dict[str, float]:
    """Count, padding efficiency (real / costed tokens) and oversized micro-batches of a split."""
    costs = [microbatch_cost(seq_lens, mb, mode=mode, pad_to_multiple_of=pad_to_multiple_of) for mb in mbs]
    real = sum(int(n) for n in seq_lens)
    return {
        "microbatch/count": float(len(mbs)),
        "microbatch/token_efficiency": real / max(sum(costs), 1),
        "microbatch/max_cost": float(max(costs, default=0)),
        "microbatch/oversized": float(sum(c > max_tokens_per_microbatch for c in costs)),
    }


def plan_minibatches(
    seq_lens: Sequence[int], *, num_minibatches: int, max_tokens_per_microbatch: int, mode: Mode = "padded",
    pad_to_multiple_of: int = 1, min_num_microbatches: int = 1,
) -> list[list[list[int]]]:
    """Micro-batches (global indices) of each contiguous mini-batch ``[i*n/M, (i+1)*n/M)``.

    The old-log-prob pass iterates ``for mini in plan: for mb in mini`` and the update does the same per
    mini-batch, so the two passes see identical micro-batches.

    >>> plan_minibatches([4, 4, 9, 1], num_minibatches=2, max_tokens_per_microbatch=8)
    [[[0, 1]], [[2], [3]]]
    """
    n = len(seq_lens)
    if num_minibatches < 1 or n % num_minibatches:
        raise ValueError(f"num_minibatches={num_minibatches} must divide the batch of {n} samples")
    step = n // num_minibatches
    plan = []
    for start in range(0, n, step):
        local = make_microbatches(
            seq_lens[start : start + step], max_tokens_per_microbatch=max_tokens_per_microbatch, mode=mode,
            pad_to_multiple_of=pad_to_multiple_of, min_num_microbatches=min_num_microbatches,
        )
        plan.append([[start + i for i in mb] for mb in local])
    return plan


def max_count_across_ranks(local_count: int, *, group=None) -> int:
    """Max of ``local_count`` over a process group (one all-reduce; a host sync, once per step)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([local_count], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
