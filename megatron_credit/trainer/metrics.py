"""Metric sums across micro-batches and ranks, their final names, and where they are written.

Loss functions return rank-local *sums* (``sum:x``), minima (``min:x``) and maxima (``max:x``) as
tensors (no host sync per micro-batch); :class:`StatSums` accumulates them, the trainer reduces them
over DP x CP once per iteration, and :func:`finalize` turns them into the documented ``group/name``
metrics (token-weighted means are ``sum:x / sum:tokens``). ``metrics.jsonl`` gets one JSON object per
iteration; TensorBoard and wandb get the same numbers.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

import torch

from megatron_credit.algorithm.metric_tables import BUILT_IN, CORE, MAX, MIN, TOKEN_MEAN, MetricTable


def loss_statistics(stats: dict[str, torch.Tensor], reduce: dict[str, str], *, tokens: torch.Tensor,
                    first: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch's rank-local loss statistics as the ``sum:`` / ``min:`` / ``max:`` entries the
    trainer reduces, each as its metric table declares (``reduce``: ``metric_tables.reductions``).

    ``tokens``: the micro-batch's valid tokens on this rank (a token mean becomes a token-weighted sum;
    an extreme of no token is NaN, which never wins the reduction). ``first``: the iteration's first
    mini-batch, whose extremes are also kept apart (``first_minibatch/``). A statistic no table declares
    is refused: the loss would be computing what nothing reads."""
    out: dict[str, torch.Tensor] = {}
    for k, v in stats.items():
        how = reduce.get(k)
        if how is None:
            raise ValueError(f"the policy loss returned the statistic {k!r}, which none of the algorithm's "
                             f"metric tables declares (MetricTable.reduce)")
        if how in (MIN, MAX):
            out[f"{how}:{k}"] = torch.where(tokens > 0, v, torch.nan)
            if first:
                out[f"{how}:first_minibatch/{k}"] = out[f"{how}:{k}"]
        else:
            out["sum:" + k] = torch.nan_to_num(v) * tokens if how == TOKEN_MEAN else torch.nan_to_num(v)
    return out

class StatSums:
    """Accumulated ``sum:`` / ``min:`` / ``max:`` tensors; ``replicated`` keys are equal on every rank
    (e.g. the gradient norm) and are not summed over ranks."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.replicated: set[str] = set()

    def add(self, stats: dict[str, torch.Tensor], *, replicated: bool = False) -> None:
        for k, v in stats.items():
            v = torch.as_tensor(v, dtype=torch.float64).detach().reshape(())
            if k not in self.values:
                self.values[k] = v.clone()
            elif k.startswith("min:"):
                self.values[k] = torch.fmin(self.values[k], v)
            elif k.startswith("max:"):
                self.values[k] = torch.fmax(self.values[k], v)
            else:
                self.values[k] = self.values[k] + v
            if replicated:
                self.replicated.add(k)

    def merge(self, other: "StatSums") -> None:
        for k, v in other.values.items():
            self.add({k: v}, replicated=k in other.replicated)

    def get(self, key: str, default: float = 0.0) -> torch.Tensor:
        return self.values.get(key, torch.tensor(default, dtype=torch.float64))

    def all_reduce(self, group, *, device: torch.device) -> None:
        """Sum / min / max the non-replicated entries over ``group`` (same keys on every rank), reduced as
        tensors on ``device`` (NCCL reduces device tensors only)."""
        import torch.distributed as dist

        if group is None or dist.get_world_size(group) == 1:
            return
        for prefix, op in (("sum:", dist.ReduceOp.SUM), ("min:", dist.ReduceOp.MIN),
                           ("max:", dist.ReduceOp.MAX)):
            keys = sorted(k for k in self.values if k.startswith(prefix) and k not in self.replicated)
            if not keys:
                continue
            vec = torch.stack([self.values[k].to(device) for k in keys])
            if prefix != "sum:":  # NaN (no valid token on a rank) must not win a min / max
                vec = torch.nan_to_num(vec, nan=math.inf if prefix == "min:" else -math.inf)
            dist.all_reduce(vec, op=op, group=group)
            for k, v in zip(keys, vec):
                self.values[k] = v


def finalize(stats: StatSums, tables: Optional[Sequence[MetricTable]] = None) -> dict[str, float]:
    """The documented metric names from reduced sums (missing inputs give no metric): the trainer's own
    (``metric_tables.CORE``), those of ``tables`` (the algorithm's, ``Algorithm.metrics``; None: every
    built-in algorithm's), and the per-rank ``sum:rank_avg/`` statistics averaged over ranks."""
    out: dict[str, float] = {}
    v = _on_host(stats.values)
    for table in (CORE, *(BUILT_IN if tables is None else tables)):
        for name, (num, den) in table.means.items():
            if num in v and den in v:
                out[name] = float(v[num] / v[den].clamp(min=1e-12))
        for name, key in table.extremes.items():
            if key in v and math.isfinite(float(v[key])):
                out[name] = float(v[key])
        for derive in table.derived:
            out.update(derive(v))
    for key, x in v.items():  # per-rank statistics (e.g. rank correlations): mean over ranks
        if key.startswith("sum:rank_avg/"):
            out[key[len("sum:rank_avg/"):]] = float(x / v["sum:rank_avg_count"].clamp(min=1))
    return out


def _on_host(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` (0-d tensors) on the host, read in one copy per device rather than one device sync per
    metric (a mixture of experts' expert counts are layers x experts of them)."""
    host, devices = {}, {}
    for k, x in values.items():
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            devices.setdefault(x.device, []).append(k)
        else:
            host[k] = x
    for keys in devices.values():
        host.update(zip(keys, torch.stack([values[k].reshape(()) for k in keys]).cpu()))
    return {k: host[k] for k in values}


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
