"""Where a run keeps its checkpoints: ``<run>/checkpoints/iter_0000012/`` with ``model_optim/`` (and
``critic_optim/``), ``rank_NNNNN.pt`` and ``meta.json`` (written last: a directory without it is not
complete). Standard library only, so the trainer's save / load (``trainer/checkpoint.py``), the resume
checks (``trainer/checkpoint_check.py``), the export of a run (``conversion/run_export.py``) and the
entry point all read one definition.

>>> checkpoint_dir("runs/demo", 12)
'runs/demo/checkpoints/iter_0000012'
"""
from __future__ import annotations

import os
import re

MODEL_OPTIM = "model_optim"
"""The policy's megatron distributed checkpoint (model + optimizer) inside a checkpoint directory."""
CRITIC_OPTIM = "critic_optim"
"""The same for a separate value model."""

_DIR = re.compile(r"^iter_(\d{7})$")


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"iter_{step:07d}")


def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints of a run, oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)
