"""A weight bucket as bytes, for the rollout pool's weights groups (``sources/bridge.py``): its names, dtypes
and shapes as JSON, and its tensors in one ``uint8`` tensor (on a GPU they never leave it)."""
from __future__ import annotations

import json

import torch

ALIGN = 16
"""Each tensor starts at a multiple of this many bytes of a packed bucket (a view of any dtype needs it)."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(bucket, device: torch.device) -> tuple[bytes, torch.Tensor]:
    """One HF-named bucket as (its names, dtypes and shapes as JSON, its bytes in one ``uint8`` tensor on
    ``device``, each tensor at a multiple of :data:`ALIGN`: on a GPU the tensors never leave it)."""
    meta = json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in bucket]).encode()
    parts = []
    for _, t in bucket:
        b = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        parts.append(b)
        if _padded(b.numel()) > b.numel():
            parts.append(torch.zeros(_padded(b.numel()) - b.numel(), dtype=torch.uint8, device=device))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return meta, flat


def unpack(meta: bytes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket of :func:`pack` (views of ``flat``).

    >>> b = [("a", torch.arange(3.0)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
    >>> [(n, t.tolist()) for n, t in unpack(*pack(b, torch.device("cpu")))]
    [('a', [0.0, 1.0, 2.0]), ('b', [[1.0, 1.0], [1.0, 1.0]])]
    """
    out, at = [], 0
    for name, dtype, shape in json.loads(meta):
        dt = getattr(torch, dtype)
        size = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        out.append((name, flat[at:at + size].view(dt).view(shape)))
        at += _padded(size)
    return out
