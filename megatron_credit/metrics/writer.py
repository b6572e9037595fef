"""Where the iteration's metrics are written: ``metrics.jsonl`` (one JSON object per iteration, appended to
by a resumed run after the lines past its checkpoint are dropped), and TensorBoard and wandb with the same
numbers. Rank 0 only; the numbers come from ``metrics/sums.finalize``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

import torch


class MetricsWriter:
    """``metrics.jsonl`` (+ TensorBoard, wandb) of rank 0; a resumed run appends to the same file."""

    def __init__(self, run_dir: str, *, resume_step: Optional[int], tensorboard: bool, wandb_project: Optional[str],
                 config: dict[str, Any], log=print):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is None:
            open(self.path, "w").close()
        else:
            truncate_metrics(self.path, after_step=resume_step)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
            except ImportError:
                log("tensorboard is not installed: no event files (pip install tensorboard)")
        self.wandb = None
        if wandb_project:
            import wandb  # the user asked for it: fail loudly if it is missing

            self.wandb = wandb.init(project=wandb_project, config=config, dir=run_dir, resume="allow")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def truncate_metrics(path: str, *, after_step: int) -> None:
    """Drop the lines of ``metrics.jsonl`` whose step is past ``after_step`` (a resumed run re-does them)."""
    if not os.path.exists(path):
        open(path, "w").close()
        return
    keep = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= after_step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
