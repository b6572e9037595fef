"""Refusing a layout the GPUs cannot hold, with the arithmetic and a layout that would fit
(``tools/plan.py``, ``pretrain_rl.py --dry-run``: said before any table is printed)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_credit.planning.plan import GIB, plan


def _with_layout(recipe, tp: int, pp: int, cp: int):
    """``recipe`` with another TP x PP x CP (sequence parallelism kept where TP > 1 allows it)."""
    par = dataclasses.replace(recipe.parallel, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp, sequence_parallel=recipe.parallel.sequence_parallel and tp > 1)
    return dataclasses.replace(recipe, parallel=par)


def _layout_text(tp: int, pp: int, cp: int) -> str:
    return (f"parallel.tensor_model_parallel_size={tp} parallel.pipeline_model_parallel_size={pp} "
            f"parallel.context_parallel_size={cp}")


def layout_refusal(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
                   distributed_optimizer: Optional[bool] = None, ep: Optional[int] = None,
                   etp: Optional[int] = None) -> Optional[str]:
    """None when TP x PP x CP divides the ``nodes x gpus_per_node`` GPUs; else why not, in arithmetic
    (``TP x PP x CP = 8 x 2 x 2 = 32 > 8 GPUs``), and a layout that would fit: the one of these GPUs
    closest to the recipe's (fewest fields changed) whose :func:`plan` fits (with the other
    distributed-optimizer choice when only that fits), or, when none does, the number of nodes on which
    the recipe's own layout fits (``ep`` / ``etp``: an MoE model's expert sizes, kept). Said before any
    table is printed."""
    p, world = recipe.parallel, nodes * gpus_per_node
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    mp = tp * pp * cp
    if world % mp == 0:
        return None
    rel = ">" if mp > world else "does not divide"
    why = (f"parallel: TP x PP x CP = {tp} x {pp} x {cp} = {mp} {rel} {world} GPUs "
           f"({nodes} node(s) x {gpus_per_node})")
    here = _fitting_layout(recipe, hf_config, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                           distributed_optimizer=distributed_optimizer, ep=ep, etp=etp)
    if here is not None:
        return f"{why}; a layout that fits: {here}"
    if distributed_optimizer is None:
        other = not (recipe.optim.distributed_optimizer or recipe.cluster.distributed_optimizer)
        here = _fitting_layout(recipe, hf_config, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                               distributed_optimizer=other, ep=ep, etp=etp)
        if here is not None:
            return f"{why}; a layout that fits with --distributed-optimizer {'on' if other else 'off'}: {here}"
    for n in range(nodes + 1, nodes + 257):
        if (n * gpus_per_node) % mp:
            continue
        result = plan(recipe, hf_config, nodes=n, gpus_per_node=gpus_per_node, gpu=gpu,
                      distributed_optimizer=distributed_optimizer, ep=ep, etp=etp)
        if result.fits:
            return (f"{why}; no layout of {world} GPUs fits this recipe in memory; this layout fits on "
                    f"{n} nodes x {gpus_per_node} GPUs ({n * gpus_per_node} GPUs, DP={result.layout['dp']}, peak "
                    f"{result.peak / GIB:.1f} of {result.gpu_bytes / GIB:.1f} GiB)")
    return f"{why}; no layout of {world} GPUs fits this recipe in memory"


def _fitting_layout(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
                    distributed_optimizer: Optional[bool], ep: Optional[int] = None,
                    etp: Optional[int] = None) -> Optional[str]:
    """The TP x PP x CP of these GPUs closest to the recipe's (fewest fields changed, then the smallest
    log2 distance, then the largest DP, then the lowest peak) whose plan fits, as overrides; None when
    none fits."""
    p, world = recipe.parallel, nodes * gpus_per_node
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    candidates = []
    for t, q, c in ((t, q, c) for t in divisors for q in divisors for c in divisors if world % (t * q * c) == 0):
        try:
            result = plan(_with_layout(recipe, t, q, c), hf_config, nodes=nodes, gpus_per_node=gpus_per_node,
                          gpu=gpu, distributed_optimizer=distributed_optimizer, ep=ep, etp=etp)
        except ValueError:
            continue
        if result.fits:
            changed = (t != tp) + (q != pp) + (c != cp)
            distance = sum(abs(math.log2(new / old)) for new, old in ((t, tp), (q, pp), (c, cp)))
            candidates.append(((changed, distance, -result.layout["dp"], result.peak), t, q, c, result))
    if not candidates:
        return None
    _, t, q, c, result = min(candidates, key=lambda x: x[0])
    return (f"{_layout_text(t, q, c)} (DP={result.layout['dp']}, peak {result.peak / GIB:.1f} of "
            f"{result.gpu_bytes / GIB:.1f} GiB)")
