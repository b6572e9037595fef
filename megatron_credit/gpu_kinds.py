"""The GPU kinds a recipe may be sized for (``cluster.gpu``, ``tools/plan.py --gpu``) and their memory.

Standard library only: the recipe (``config.ClusterConfig``) checks a name against it and the memory
planner (``planning``) reads the bytes, so neither imports the other for it.
"""
from __future__ import annotations

from typing import Mapping

GIB = 1024 ** 3

GPUS: Mapping[str, int] = {
    # Total memory nvidia-smi reports (MiB): what CUDA can allocate before the context is created.
    "h100-80gb": 81559 * 1024 ** 2,   # H100 SXM5 80GB: 81559 MiB
    "h200": 143771 * 1024 ** 2,       # H200 SXM 141GB: 143771 MiB
    "a100-80gb": 81920 * 1024 ** 2,   # A100 SXM4 80GB: 81920 MiB
    "a100-40gb": 40960 * 1024 ** 2,   # A100 SXM4 40GB: 40960 MiB
}
"""Per-GPU memory in bytes by name (``--gpu``, ``cluster.gpu``)."""
