"""How long one RL iteration and one checkpoint save take, roughly, and so how early a scheduler must warn.

Slurm ends a job at its time limit with SIGTERM and, ``KillWait`` seconds later (30 by default), SIGKILL.
An iteration of a 32B recipe takes many minutes, so a run must be warned ahead (``sbatch
--signal=USR1@<lead>``), by at least one iteration plus one save (``checkpoint.exit_signals``: the
iteration in flight is finished and saved). :func:`iteration_estimate` gives that lead for a recipe on
a cluster, from arithmetic on the architecture (no GPU), deliberately on the slow side:

* **generation** is memory-bound decoding: every response runs to ``rollout.max_response_len``, and at
  each decode step each engine GPU reads its share of the weights and of the KV cache of its sequences
  (context grows from the prompt to prompt + response), at :data:`DECODE_EFFICIENCY` of its HBM
  bandwidth. One draw of ``prompts_per_step x n`` (dynamic sampling's extra draws are in the margin);
* **training**: a forward of every sequence for the old log-probs (and the reference's and a separate
  critic's), then forward and backward (3 forwards; 4 with full recompute) per epoch; a forward is
  ``2 x params`` FLOPs per token (an MoE model's active parameters: top-k experts) plus causal attention, at :data:`TRAIN_MFU` of the GPUs' dense bf16 peak;
* **a save** writes the weights, fp32 master weights (when the parameters are not fp32) and Adam's two
  moments (and a separate critic's) at ``disk_bytes_per_s`` per node, all nodes writing at once.

The lead is ``(iteration + save) x`` :data:`MARGIN`, rounded up to a minute. These are estimates with stated
assumptions, not measurements: time one iteration and one save of the real run (``time/step_s`` in
``metrics.jsonl``, the save in the log) and set the lead from those once known.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_credit.planning.gpu_kinds import GIB

GPU_SPEEDS = {
    # (dense bf16 peak FLOP/s, HBM bytes/s), SXM parts, from the vendors' data sheets
    "h100-80gb": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
    "a100-80gb": (312e12, 2.039e12),
    "a100-40gb": (312e12, 1.555e12),
}
"""Speeds per ``cluster.gpu`` kind (the keys of ``gpu_kinds.GPUS``)."""
TRAIN_MFU = 0.3
"""Fraction of the dense peak the training passes reach (megatron reaches 0.4-0.5 on dense models at these
sizes; 0.3 leaves room for pipeline bubbles and short micro-batches)."""
DECODE_EFFICIENCY = 0.5
"""Fraction of HBM bandwidth decoding reaches."""
DISK_BYTES_PER_S = 1e9
"""Default write bandwidth of one node to the checkpoint folder (1 GB/s: a conservative figure for a
shared parallel filesystem; ``tools/plan.py --disk-gbps`` states yours)."""
MARGIN = 1.25
"""Headroom over the estimate (a slow draw, dynamic sampling's extra draws, validation)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IterationEstimate:
    """Seconds of one iteration's parts and of one save, and the warning lead they imply."""

    generation_s: float
    training_s: float
    save_s: float
    checkpoint_bytes: int
    lead_s: int
    """Seconds before the time limit the run must be warned: ``(iteration + save) x MARGIN``, whole minutes."""

    @property
    def iteration_s(self) -> float:
        return self.generation_s + self.training_s

    def lines(self) -> list[str]:
        """The estimate as printed by ``tools/plan.py``."""
        return [f"one iteration (estimate): generation {self.generation_s:,.0f} s + training {self.training_s:,.0f} s"
                f" = {self.iteration_s:,.0f} s; one save: {self.checkpoint_bytes / GIB:,.0f} GiB in "
                f"{self.save_s:,.0f} s",
                f"Slurm warning lead (iteration + save, x{MARGIN:g}): sbatch --signal=USR1@{self.lead_s}"
                + ("" if self.lead_s <= 65535 else " (over Slurm's 65535 s: save more often, checkpoint.every)")]


def iteration_estimate(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
                       disk_bytes_per_s: float = DISK_BYTES_PER_S) -> IterationEstimate:
    """The module docstring's estimate for ``recipe`` on ``nodes x gpus_per_node`` GPUs of kind ``gpu``."""
    from megatron_credit.planning.plan import (DTYPE_BYTES, Architecture, _critic_params, _dtype_name,
                                               kv_bytes_per_token, total_param_count)
    from megatron_credit.planning.architecture import active_param_count

    if gpu not in GPU_SPEEDS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPU_SPEEDS)}")
    if not disk_bytes_per_s > 0:
        raise ValueError(f"the disk bandwidth must be > 0, got {disk_bytes_per_s}")
    peak, hbm = GPU_SPEEDS[gpu]
    a = Architecture.from_hf(hf_config)
    r, t = recipe.rollout, recipe.train
    world, params = nodes * gpus_per_node, total_param_count(a)
    dtype_bytes = DTYPE_BYTES[_dtype_name(recipe, hf_config)]
    critic, separate = _critic_params(recipe, a, actor_params=params)
    prompt, response, sequences = recipe.data.max_prompt_len, recipe.response_budget, r.prompts_per_step * r.n

    rtp = int(dict(r.engine_options).get("tensor_parallel_size", 1) or 1)
    engines = max(world // rtp, 1)
    kv_read = sequences / engines * (prompt * response + response * response / 2) * kv_bytes_per_token(
        a, tp=rtp, dtype_bytes=dtype_bytes)  # per engine GPU, over the whole generation
    weights_read = response * params * dtype_bytes / rtp
    generation_s = (kv_read + weights_read) / (hbm * DECODE_EFFICIENCY)

    seq = prompt + response
    attention = 2 * a.num_layers * seq * a.num_heads * a.head_dim  # causal QK^T and AV, per token, mean context
    forward = (2 * active_param_count(a) + attention) * sequences * seq
    passes = 1 + (recipe.algorithm.kl_coef > 0) + separate  # old log-probs, reference, a separate critic's values
    per_epoch = 4 if t.recompute == "full" else 3
    training_s = forward * (passes + per_epoch * t.epochs * (1 + separate)) / (world * peak * TRAIN_MFU)

    state = dtype_bytes + (4 if dtype_bytes < 4 else 0) + 8  # weights, fp32 master, Adam's two moments
    checkpoint_bytes = (params + critic) * state
    save_s = checkpoint_bytes / (nodes * disk_bytes_per_s)
    lead = math.ceil((generation_s + training_s + save_s) * MARGIN / 60) * 60
    return IterationEstimate(generation_s=generation_s, training_s=training_s, save_s=save_s,
                             checkpoint_bytes=int(checkpoint_bytes), lead_s=max(lead, 60))
