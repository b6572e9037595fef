"""Copy streamed HF-named tensors into a live ``torch.nn.Module`` in place (no disk round trip).

The actor's conversion layer yields ``Iterable[list[tuple[str, Tensor]]]`` -- size-bounded buckets of
(HF parameter name, tensor). :func:`load_named_tensor_buckets` checks each bucket fully (every name
known, every shape equal) before copying any of it, so a bad bucket never half-applies, and by default
insists that every parameter was covered once the stream ends. Tied parameters (one tensor reachable
under two names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) count as covered when
either name arrives.

>>> m = torch.nn.Linear(2, 1)
>>> load_named_tensor_buckets(m, [[("weight", torch.ones(1, 2))], [("bias", torch.zeros(1))]])
2
>>> m.weight.tolist()
[[1.0, 1.0]]
>>> load_named_tensor_buckets(m, [[("weigth", torch.ones(1, 2))]])
Traceback (most recent call last):
...
ValueError: weight sync: unknown parameter 'weigth' (not in the rollout model; it has e.g. ['bias', 'weight'])
"""
from __future__ import annotations

from typing import Iterable

import torch


def load_named_tensor_buckets(
    module: torch.nn.Module, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, strict: bool = True
) -> int:
    """Copy every (name, tensor) of every bucket into ``module``'s state in place; return the count.

    Tensors are cast to the destination's dtype and device by ``copy_``. Raises ValueError naming the
    tensor for an unknown name or a shape mismatch, and (``strict``) listing the parameters that no
    bucket covered. Buckets before a failing one stay applied.
    """
    targets = module.state_dict(keep_vars=True)
    by_identity: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        by_identity.setdefault(id(tensor), []).append(name)
    covered: set[int] = set()
    count = 0
    for bucket in buckets:
        for name, tensor in bucket:
            _check(name, tensor, targets)
        with torch.no_grad():
            for name, tensor in bucket:
                dst = targets[name]
                dst.copy_(tensor)
                covered.add(id(dst))
                count += 1
    if strict:
        missing = [names[0] for key, names in by_identity.items() if key not in covered]
        if missing:
            raise ValueError(
                f"weight sync: {len(missing)} parameter(s) of the rollout model received no tensor, "
                f"e.g. {sorted(missing)[:8]}"
            )
    return count


def _check(name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
    if name not in targets:
        raise ValueError(
            f"weight sync: unknown parameter {name!r} (not in the rollout model; it has e.g. "
            f"{sorted(targets)[:8]})"
        )
    want = tuple(targets[name].shape)
    if tuple(tensor.shape) != want:
        raise ValueError(f"weight sync: shape mismatch for {name!r}: got {tuple(tensor.shape)}, model has {want}")
