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
from typing import Any, Optional

import torch

# metric -> (numerator, denominator) of the token- or step-weighted means of finalize().
_MEANS = {
    "actor/pg_loss": ("sum:pg_loss", "sum:opt_steps"),
    "actor/entropy": ("sum:entropy", "sum:tokens"),
    "actor/ppo_kl": ("sum:approx_kl", "sum:tokens"),
    "actor/clipfrac_high": ("sum:clipfrac_high", "sum:tokens"),
    "actor/clipfrac_low": ("sum:clipfrac_low", "sum:tokens"),
    "actor/clipfrac_dual": ("sum:clipfrac_dual", "sum:tokens"),
    "actor/logp_diff_abs": ("sum:logp_diff", "sum:tokens"),
    "actor/kl_ref": ("sum:kl", "sum:tokens"),
    "actor/grad_norm": ("sum:grad_norm", "sum:opt_steps"),
    "fipo/weight_mean": ("sum:fipo_weight/mean", "sum:tokens"),
    "fipo/frac_at_high": ("sum:fipo_weight/frac_at_high", "sum:tokens"),
    "fipo/frac_dual_masked": ("sum:fipo_weight/frac_dual_masked", "sum:tokens"),
    "critic/value_loss": ("sum:value_loss", "sum:opt_steps"),
    "critic/grad_norm": ("sum:critic_grad_norm", "sum:opt_steps"),
    "comppo/gate_mean": ("sum:gate", "sum:gate_tokens"),
    "comppo/transport_mean": ("sum:transport", "sum:gate_tokens"),
    "comppo/gate_first_third": ("sum:gate_first", "sum:gate_first_tokens"),
    "comppo/gate_mid_third": ("sum:gate_mid", "sum:gate_mid_tokens"),
    "comppo/gate_last_third": ("sum:gate_last", "sum:gate_last_tokens"),
    "mismatch/logprob_abs_mean": ("sum:mismatch_abs", "sum:mismatch_tokens"),
    "mismatch/tis_weight_mean": ("sum:tis_mean_weight", "sum:tokens"),
    "mismatch/tis_capped_frac": ("sum:tis_capped_frac", "sum:tokens"),
}
_EXTREMES = {"fipo/weight_min": "min:fipo_weight/min", "fipo/weight_max": "max:fipo_weight/max"}


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


def finalize(stats: StatSums) -> dict[str, float]:
    """The documented metric names from reduced sums (missing inputs give no metric)."""
    out: dict[str, float] = {}
    for name, (num, den) in _MEANS.items():
        if num in stats.values and den in stats.values:
            out[name] = float(stats.values[num] / stats.values[den].clamp(min=1e-12))
    for name, key in _EXTREMES.items():
        if key in stats.values and math.isfinite(float(stats.values[key])):
            out[name] = float(stats.values[key])
    for key, v in stats.values.items():  # per-rank statistics (e.g. rank correlations): mean over ranks
        if key.startswith("sum:rank_avg/"):
            out[key[len("sum:rank_avg/"):]] = float(v / stats.values["sum:rank_avg_count"].clamp(min=1))
    lo, hi = stats.values.get("min:first_minibatch/fipo_weight/min"), stats.values.get("max:first_minibatch/fipo_weight/max")
    if lo is not None and hi is not None and math.isfinite(float(lo)) and math.isfinite(float(hi)):
        out["fipo/first_minibatch_max_abs_dev"] = max(float(hi) - 1.0, 1.0 - float(lo))  # on-policy: 0
    if "sum:fipo_weight/dev_sq" in stats.values and "sum:fipo_weight/mean" in stats.values:
        n = stats.values["sum:tokens"].clamp(min=1e-12)  # std of the weights over every valid token
        var = stats.values["sum:fipo_weight/dev_sq"] / n - (stats.values["sum:fipo_weight/mean"] / n - 1) ** 2
        out["fipo/weight_std"] = math.sqrt(max(float(var), 0.0))
    if "sum:skipped_steps" in stats.values:
        out["actor/skipped_steps"] = float(stats.values["sum:skipped_steps"])
    if "sum:critic_skipped_steps" in stats.values:  # a separate critic's own optimizer
        out["critic/skipped_steps"] = float(stats.values["sum:critic_skipped_steps"])
    if "sum:ret" in stats.values:
        n = stats.values["sum:tokens"].clamp(min=1)
        var = lambda s, s2: s2 / n - (s / n) ** 2  # noqa: E731
        v_ret = var(stats.values["sum:ret"], stats.values["sum:ret2"])
        v_res = var(stats.values["sum:resid"], stats.values["sum:resid2"])
        out["critic/explained_var"] = float(1 - v_res / v_ret.clamp(min=1e-12))
    return out


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
