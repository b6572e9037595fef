"""Metric sums across micro-batches and ranks, reduced once per iteration and named.

Loss functions return rank-local *sums* (``sum:x``), minima (``min:x``) and maxima (``max:x``) as
tensors (no host sync per micro-batch); :class:`StatSums` accumulates them, :class:`Reduction` reduces
them over DP x CP once per iteration and turns them into the documented ``group/name`` metrics
(:func:`finalize`; token-weighted means are ``sum:x / sum:tokens``) as the metric tables declare
(``metrics/tables.py``). ``metrics/writer.py`` writes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_credit.metrics.tables import BUILT_IN, CORE, MAX, MIN, TOKEN_MEAN, MetricTable, reductions


def loss_statistics(stats: dict[str, torch.Tensor], tables: Sequence[MetricTable], *, tokens: torch.Tensor,
                    first: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch's rank-local loss statistics as the ``sum:`` / ``min:`` / ``max:`` entries the
    trainer reduces, each as the ``tables`` declare (``tables.reductions``).

    ``tokens``: the micro-batch's valid tokens on this rank (a token mean becomes a token-weighted sum;
    an extreme of no token is NaN, which never wins the reduction). ``first``: the iteration's first
    mini-batch, whose extremes are also kept apart (``first_minibatch/``). A statistic no table declares
    is refused: the loss would be computing what nothing reads."""
    reduce = reductions(tables)
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


def on_host(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` (scalar tensors) with those on a device brought to the host in one copy: the metrics of an
    iteration make the host wait for the device once, not once per metric."""
    moved = [k for k, x in values.items() if x.device.type != "cpu"]
    if not moved:
        return values
    host = torch.stack([values[k].reshape(()).to(torch.float64) for k in moved]).cpu()
    return {**values, **dict(zip(moved, host.unbind()))}


def finalize(stats: StatSums, tables: Optional[Sequence[MetricTable]] = None) -> dict[str, float]:
    """The documented metric names from reduced sums (missing inputs give no metric): the trainer's own
    (``tables.CORE``), those of ``tables`` (the algorithm's, ``Algorithm.metrics``; None: every
    built-in algorithm's), and the per-rank ``sum:rank_avg/`` statistics averaged over ranks."""
    out: dict[str, float] = {}
    v = on_host(stats.values)
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


@dataclass(frozen=True)
class Reduction:
    """Where an iteration's sums become its metrics: summed over ``group`` (DP x CP) on the last pipeline
    stage, handed to the other stages of ``pp_group`` from its global rank ``pp_src`` when there is a
    pipeline, and named by :func:`finalize` with ``tables`` (the algorithm's and the model's). Built once
    per launch (``trainer/context.py``); calling it reduces one iteration's :class:`StatSums`."""

    tables: tuple[MetricTable, ...]
    group: Any
    device: torch.device
    pp_group: Any = None
    pp_src: Optional[int] = None

    def __call__(self, stats: StatSums) -> dict[str, float]:
        import torch.distributed as dist

        stats.all_reduce(self.group, device=self.device)
        if self.pp_group is not None:
            box = [stats.values]
            dist.broadcast_object_list(box, src=self.pp_src, group=self.pp_group, device=self.device)
            stats.values = box[0]
        return finalize(stats, self.tables)
