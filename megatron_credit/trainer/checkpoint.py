"""Checkpoints of a run: every rank's model, optimizer, RNG and data position, written atomically.

Layout: ``<run>/checkpoints/iter_0000012/rank_00003.pt`` (one file per rank: its shard of the model
and of the optimizer state, its data cursor, its RNG states) plus ``meta.json`` (step, world layout).
Every rank writes into ``iter_0000012.tmp``; after a barrier rank 0 renames the directory, so a crash
or a SIGKILL during a save never leaves a directory that looks complete, and ``--resume auto`` takes
the newest directory without the ``.tmp`` suffix. Loading uses ``torch.load(weights_only=True)``:
no pickled code runs from a checkpoint. The layout (TP / PP / CP / DP sizes) must match on resume;
``meta.json`` is checked and a different layout is refused with a clear error (resharding a run's
checkpoint goes through the megatron ``torch_dist`` converter, ``tools/``).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

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


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import random as mrandom

    state = {"torch": torch.get_rng_state(), "python": list(_py_state()),
             "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _py_state():
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(run_dir: str, step: int, state: dict[str, Any], *, layout: dict[str, int], keep: int) -> str:
    """Collective: every rank writes its file; rank 0 publishes the directory and prunes old ones."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = checkpoint_dir(run_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    path = os.path.join(tmp, f"rank_{rank:05d}.pt")
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump({"step": step, "layout": layout}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the publication: a directory without .tmp is complete
        for _, old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def resolve(run_dir: str, resume: str) -> Optional[str]:
    """``--resume``: ``none`` -> None; ``auto`` -> the newest complete checkpoint (or None); a path."""
    if resume == "none":
        return None
    if resume == "auto":
        done = complete_checkpoints(run_dir)
        return done[-1][1] if done else None
    if not os.path.exists(os.path.join(resume, "meta.json")):
        raise ValueError(f"--resume {resume}: not a complete checkpoint directory (no meta.json)")
    return resume


def load(path: str, *, layout: dict[str, int]) -> tuple[int, dict[str, Any]]:
    """This rank's state from checkpoint ``path``; refuses a checkpoint of another layout."""
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("layout") != layout:
        raise ValueError(f"checkpoint {path} was written with layout {meta.get('layout')}, this run has "
                         f"{layout}; resume with the same TP/PP/CP/DP sizes")
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True)
    return int(meta["step"]), state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
