"""One report of a recipe on a launch, printed alike by ``tools/plan.py`` and ``pretrain_rl.py --dry-run``:
the memory plan (the trainer's GPUs, and a rollout pool's apart), the time of one iteration and of the whole
run with the disk its checkpoints take (``planning.timing``: one model of time, the pool's generation in
it), then the preflight (``planning.preflight``).

A launch is ``nodes x gpus_per_node`` GPUs as torchrun counts them: with ``rollout.ranks`` the last that-many
are the pool's and the trainer's layout is that of the rest (``planning.pool.trainer_gpus``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_credit.planning.timing import DISK_BYTES_PER_S, IterationEstimate


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchReport:
    """What :func:`launch_report` found: the lines to print, the verdict and the estimate."""

    lines: list[str]
    fits: bool
    """The trainer's plan and the pool's (when there is one) both fit."""
    estimate: IterationEstimate
    trainer_nodes: int
    trainer_gpus_per_node: int
    problems: list[str] = dataclasses.field(default_factory=list)
    """What makes a plan that fits unrunnable as it stands (the collective timeout), one line each: printed
    as ``error:`` lines after the report, exit 2."""
    plan: object = None
    """The trainer's :class:`~megatron_credit.planning.plan.Plan`."""
    pool: object = None
    """A rollout pool's :class:`~megatron_credit.planning.pool.PoolPlan` (None without one)."""

    def as_dict(self) -> dict:
        """The whole report as one JSON-able object (``tools/plan.py --json``): the trainer's plan, the pool's
        with its ``balance`` (each side's share of the iteration spent waiting), the time estimate, the
        verdict and the problems. Bytes are bytes, times seconds."""
        e = self.estimate
        trainer_idle, pool_idle = e.idle_fracs()
        out = {"fits": self.fits, "trainer_nodes": self.trainer_nodes,
               "trainer_gpus_per_node": self.trainer_gpus_per_node,
               "trainer": {**_jsonable(self.plan), "fits": self.plan.fits},
               "estimate": {**_jsonable(e), "iteration_s": e.iteration_s, "run_s": e.run_s,
                            "disk_bytes": e.disk_bytes},
               "problems": list(self.problems)}
        if self.pool is not None:
            out["pool"] = {**_jsonable(self.pool), "fits": self.pool.fits,
                           "balance": {"trainer_idle_frac": trainer_idle, "pool_idle_frac": pool_idle}}
        return out


def _jsonable(obj):
    """A dataclass (or mapping, tuple) of numbers and strings as plain dicts and lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def launch_report(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str, title: str,
                  distributed_optimizer: Optional[bool] = None, ep: Optional[int] = None,
                  etp: Optional[int] = None, disk_bytes_per_s: float = DISK_BYTES_PER_S,
                  network_gbps: Optional[float] = None) -> LaunchReport:
    """The plan and time of ``recipe`` on ``nodes x gpus_per_node`` GPUs of kind ``gpu``. A layout that
    cannot exist, or a pool whose engines cannot hold a sequence, is refused (``ValueError``, one line)
    before any table."""
    from megatron_credit.planning.layouts import layout_refusal
    from megatron_credit.planning.plan import GPUS, format_plan, plan
    from megatron_credit.planning.pool import NETWORK_GBPS, plan_pool, trainer_gpus
    from megatron_credit.planning.timing import iteration_estimate

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPUS)}")
    pool, t_nodes, t_gpn = None, nodes, gpus_per_node
    if recipe.rollout.ranks:  # the last rollout.ranks GPUs are the pool's: the trainer is planned on the rest
        pool = plan_pool(recipe, hf_config, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                         network_gbps=network_gbps or NETWORK_GBPS)
        if pool.problems:
            raise ValueError(pool.refusal())
        t_nodes, t_gpn = trainer_gpus(recipe, nodes=nodes, gpus_per_node=gpus_per_node)
    experts = dict(ep=ep, etp=etp)
    refusal = layout_refusal(recipe, hf_config, nodes=t_nodes, gpus_per_node=t_gpn, gpu=gpu,
                             distributed_optimizer=distributed_optimizer, **experts)
    if refusal is not None:  # no table for a layout that cannot exist
        raise ValueError(refusal)
    result = plan(recipe, hf_config, nodes=t_nodes, gpus_per_node=t_gpn, gpu=gpu,
                  distributed_optimizer=distributed_optimizer, **experts)
    lines = [format_plan(result, title=f"{title}: {recipe.algorithm.name}, {t_nodes} node(s) x {t_gpn} {gpu}"
                                       + (" (the trainer's)" if pool else ""))]
    if pool is not None:
        lines += pool.lines()
    estimate = iteration_estimate(recipe, hf_config, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                                  disk_bytes_per_s=disk_bytes_per_s, network_gbps=network_gbps, ep=ep)
    lines += estimate.lines()
    if pool is not None:
        warning = balance_warning(recipe, hf_config, estimate, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                                  disk_bytes_per_s=disk_bytes_per_s, network_gbps=network_gbps)
        if warning:
            lines.append(warning)
    fits = result.fits and (pool is None or pool.fits)
    problems = []
    try:
        lines.append(collective_timeout_line(recipe, estimate))
    except ValueError as exc:
        if fits:
            problems.append(str(exc))
        else:  # refused for its memory already (exit 1): the timeout is a note beside it
            lines.append(f"collective timeout: {exc}")
    return LaunchReport(lines=lines, fits=fits, estimate=estimate, trainer_nodes=t_nodes,
                        trainer_gpus_per_node=t_gpn, problems=problems, plan=result, pool=pool)


IDLE_WARNING = 0.5
"""A pool recipe one of whose sides waits for more than this share of the iteration gets a warning line."""
BALANCED = 0.25
"""A split is balanced when neither side waits for more than this share of the iteration."""


def balance_warning(recipe, hf_config, estimate: IterationEstimate, *, nodes: int, gpus_per_node: int, gpu: str,
                    disk_bytes_per_s: float = DISK_BYTES_PER_S, network_gbps: Optional[float] = None) -> str:
    """A ``warning:`` line when one side of a pool waits more than :data:`IDLE_WARNING` of the iteration, with
    the split that :func:`balanced_split` finds ("" otherwise)."""
    trainer_idle, pool_idle = estimate.idle_fracs()
    worst = max(trainer_idle, pool_idle)
    if worst <= IDLE_WARNING:
        return ""
    side, other = ("trainer", "pool") if trainer_idle >= pool_idle else ("pool", "trainer")
    head = f"warning: the {side} waits {100 * worst:.0f}% of each iteration for the {other}"
    found = balanced_split(recipe, hf_config, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                           disk_bytes_per_s=disk_bytes_per_s, network_gbps=network_gbps)
    if found is None:
        return (f"{head}; no rollout.ranks on up to {4 * nodes} nodes of {gpus_per_node} brings both sides within "
                f"{100 * BALANCED:.0f}% at this layout")
    n, ranks, e = found
    t, p = e.idle_fracs()
    where = "on these GPUs" if n == nodes else f"on {n} nodes ({n - nodes:+d})"
    return (f"{head}; {where}, rollout.ranks={ranks} balances it: one iteration {e.iteration_s:,.0f} s against "
            f"{estimate.iteration_s:,.0f} s, the trainer waiting {100 * t:.0f}% and the pool {100 * p:.0f}%")


def balanced_split(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
                   disk_bytes_per_s: float = DISK_BYTES_PER_S, network_gbps: Optional[float] = None,
                   max_nodes: Optional[int] = None):
    """``(nodes, rollout.ranks, estimate)`` of the split of a launch between trainer and pool, at the recipe's
    own layout and engine size, under which neither side waits more than :data:`BALANCED` of the iteration:
    on these ``nodes`` if one exists (the shortest iteration), else on the fewest nodes up to ``max_nodes``
    (4 x ``nodes``). Every split counted has a pool and a trainer whose plans fit. None when none does."""
    from megatron_credit.planning.plan import plan
    from megatron_credit.planning.layouts import layout_refusal
    from megatron_credit.planning.pool import NETWORK_GBPS, plan_pool, trainer_gpus
    from megatron_credit.planning.timing import iteration_estimate

    rtp, mp = recipe.rollout.tensor_parallel_size, recipe.parallel.model_parallel_size
    for n in range(nodes, (max_nodes or 4 * nodes) + 1):
        world, best = n * gpus_per_node, None
        for ranks in range(rtp, world, rtp):
            if (world - ranks) % mp:
                continue
            split = dataclasses.replace(recipe, rollout=dataclasses.replace(recipe.rollout, ranks=ranks))
            if not plan_pool(split, hf_config, nodes=n, gpus_per_node=gpus_per_node, gpu=gpu,
                             network_gbps=network_gbps or NETWORK_GBPS).fits:
                continue
            t_nodes, t_gpn = trainer_gpus(split, nodes=n, gpus_per_node=gpus_per_node)
            if layout_refusal(split, hf_config, nodes=t_nodes, gpus_per_node=t_gpn, gpu=gpu) is not None or \
                    not plan(split, hf_config, nodes=t_nodes, gpus_per_node=t_gpn, gpu=gpu).fits:
                continue
            e = iteration_estimate(split, hf_config, nodes=n, gpus_per_node=gpus_per_node, gpu=gpu,
                                   disk_bytes_per_s=disk_bytes_per_s, network_gbps=network_gbps)
            if max(e.idle_fracs()) <= BALANCED and (best is None or e.iteration_s < best[2].iteration_s):
                best = (n, ranks, e)
        if best is not None:
            return best
    return None


TIMEOUT_HEADROOM = 2.0
"""How much longer than one generation phase the collective timeout must be: ranks of ``sync`` wait in their
groups (on the host) for a whole draw, and the estimate is an estimate."""


def collective_timeout_line(recipe, estimate: IterationEstimate) -> str:
    """``distributed.timeout_s`` against one generation phase: a line when it has :data:`TIMEOUT_HEADROOM`
    over the estimate, else a ``ValueError`` naming the field and the value that would. A rollout pool's
    trainer waits for samples on silence (``rollout.wait_timeout_s``), not in a collective: no bound then."""
    timeout = recipe.distributed.timeout_s
    if recipe.rollout.ranks:
        return (f"collective timeout: distributed.timeout_s={timeout:,.0f} s (the trainer waits for the pool on "
                f"silence: rollout.wait_timeout_s={recipe.rollout.wait_timeout_s:,.0f} s)")
    need = estimate.generation_s * TIMEOUT_HEADROOM
    if timeout < need:
        raise ValueError(f"distributed.timeout_s={timeout:,.0f} is within {TIMEOUT_HEADROOM:g}x of one generation "
                         f"phase ({estimate.generation_s:,.0f} s estimated), which ranks wait out in their groups: "
                         f"set distributed.timeout_s={math.ceil(need / 3600) * 3600} or more")
    return (f"collective timeout: distributed.timeout_s={timeout:,.0f} s, {timeout / max(estimate.generation_s, 1e-9):,.1f}x "
            "one generation phase (at least 2x)")


def preflight_lines(recipe, *, run_dir: str, estimate: IterationEstimate) -> tuple[list[str], list[str]]:
    """(lines of the checks that passed, ``error: ...`` lines of those that failed) for ``run_dir``, whose
    file system must hold the checkpoints of :attr:`IterationEstimate.disk_bytes`."""
    from megatron_credit.planning.preflight import preflight

    checks = preflight(recipe, run_dir=run_dir, checkpoint_bytes=estimate.checkpoint_bytes)
    ok = ["preflight:"] + [c.line() for c in checks if c.problem is None]
    return ok, [c.line() for c in checks if c.problem is not None]
