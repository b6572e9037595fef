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
  ``2 x params`` FLOPs per token (an MoE model's active parameters: top-k experts) plus causal attention, at :data:`TRAIN_MFU` of the GPUs' dense bf16 peak.
  With LoRA the base's weight gradients are not computed: its linears' backward is one forward, not two
  (the adapters' own FLOPs, rank / hidden of the linears', are left out);
* **an MoE model's experts** run as Transformer Engine's grouped GEMM on GPU (megatron's ``TEGroupedMLP``:
  one call per linear and layer for all local experts), assumed as efficient as a dense GEMM, so inside
  :data:`TRAIN_MFU` with nothing added. With ``SequentialMLP`` instead (``moe.grouped_gemm: false``, or
  ``model.transformer_impl: local``; ``planning/experts.expert_module``) every local expert's fc1 and fc2 is
  a call of its own: ``2 E / EP`` per layer in a forward, twice that in a backward (input and weight
  gradients; input only for LoRA's frozen experts), each adding :data:`EXPERT_GEMM_CALL_S`, for the
  micro-batches of one DP replica (full-length sequences packed into ``train.max_tokens_per_microbatch``)
  on the ``L / PP`` layers of a stage (the stages run theirs side by side). The FLOPs are the same;
  nothing else about the experts' speed (routing imbalance, the all-to-all) is modelled;
* **a save** writes the weights, fp32 master weights (when the parameters are not fp32) and Adam's two
  moments (and a separate critic's) at ``disk_bytes_per_s`` per node, all nodes writing at once.

The lead is ``(iteration + save) x`` :data:`MARGIN`, rounded up to a minute. These are estimates with stated
assumptions, not measurements: time one iteration and one save of the real run (``time/step_s`` in
``metrics.jsonl``, the save in the log) and set the lead from those once known.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_credit.gpu_kinds import GIB

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
EXPERT_GEMM_CALL_S = 20e-6
"""Host time of one expert GEMM call when megatron's ``SequentialMLP`` runs a layer's local experts one by one:
the Python dispatch of a Transformer Engine linear and its kernel launch, forward or backward, which the GPU
waits for when the experts' GEMMs are small. An assumption, not measured here; ``TEGroupedMLP`` makes one
grouped call per linear whatever the experts (counted as none)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IterationEstimate:
    """Seconds of one iteration's parts and of one save, the whole run, the disk it keeps, and the warning lead.

    ``sync``: the engines share the trainer's GPUs, so an iteration is generation, then training. A rollout
    pool (``rollout.ranks``) generates on GPUs of its own while the trainer trains on the rest: with a
    staleness bound of at least one version the two overlap, and the iteration is the slower side (the pool's
    generation, or the trainer's training plus the weight update it sends); at ``max_staleness: 0`` they take
    turns, as in ``sync``."""

    generation_s: float
    """One draw of ``prompts_per_step x n`` on the engines (the pool's, when there is one)."""
    training_s: float
    """The trainer's passes over one iteration's samples."""
    update_s: float = 0.0
    """A rollout pool's weight update: the trainer sends a version to every engine (0 without a pool)."""
    expert_calls_s: float = 0.0
    """Of ``training_s``: ``SequentialMLP``'s per-expert GEMM calls (0 for a dense model and for TE's grouped
    experts; the module docstring)."""
    overlapped: bool = False
    """Whether generation overlaps training (a pool with ``max_staleness`` >= 1)."""
    save_s: float
    checkpoint_bytes: int
    steps: int = 1
    """``train.steps``: the iterations of the whole run."""
    saves: int = 0
    """Saves over the run (every ``checkpoint.every`` iterations, and the last)."""
    keep: int = 1
    """``checkpoint.keep``: complete checkpoints kept on disk."""
    lead_s: int
    """Seconds before the time limit the run must be warned: ``(iteration + save) x MARGIN``, whole minutes."""

    @property
    def iteration_s(self) -> float:
        if self.overlapped:
            return max(self.generation_s, self.training_s + self.update_s)
        return self.generation_s + self.training_s + self.update_s

    @property
    def run_s(self) -> float:
        """``train.steps`` iterations and their saves."""
        return self.steps * self.iteration_s + self.saves * self.save_s

    @property
    def disk_bytes(self) -> int:
        """The checkpoint folder at its fullest: ``keep`` complete checkpoints and the one being written (the
        oldest is removed only once the new one is complete)."""
        return (self.keep + 1) * self.checkpoint_bytes

    def idle_fracs(self) -> tuple[float, float]:
        """``(trainer, pool)``: the share of an overlapped iteration each side waits for the other (0, 0
        without a pool that overlaps training)."""
        if not self.overlapped:
            return 0.0, 0.0
        trainer, iteration = self.training_s + self.update_s, self.iteration_s
        if iteration <= 0:
            return 0.0, 0.0
        return 1 - trainer / iteration, 1 - self.generation_s / iteration

    def balance(self) -> str:
        """Which side of a pool waits, and for what share of the iteration ("" without a pool)."""
        if not self.overlapped:
            return ""
        trainer = self.training_s + self.update_s
        if self.generation_s >= trainer:
            idle = self.idle_fracs()[0]
            return (f"balance: the trainer waits {100 * idle:.0f}% of each iteration for the pool (generation "
                    f"{self.generation_s:,.0f} s vs training + update {trainer:,.0f} s): more pool GPUs "
                    "(rollout.ranks) would shorten the iteration")
        idle = self.idle_fracs()[1]
        return (f"balance: the pool waits {100 * idle:.0f}% of each iteration for the trainer (training + update "
                f"{trainer:,.0f} s vs generation {self.generation_s:,.0f} s)")

    def lines(self) -> list[str]:
        """The estimate as printed by ``tools/plan.py`` and ``pretrain_rl.py --dry-run``."""
        if self.overlapped:
            head = (f"one iteration (estimate): max(generation {self.generation_s:,.0f} s on the pool, training "
                    f"{self.training_s:,.0f} s + weight update {self.update_s:,.0f} s) = {self.iteration_s:,.0f} s")
        else:
            head = (f"one iteration (estimate): generation {self.generation_s:,.0f} s + training "
                    f"{self.training_s:,.0f} s" + (f" + weight update {self.update_s:,.0f} s" if self.update_s else "")
                    + f" = {self.iteration_s:,.0f} s")
        out = [f"{head}; one save: {self.checkpoint_bytes / GIB:,.0f} GiB in {self.save_s:,.0f} s",
               f"Slurm warning lead (iteration + save, x{MARGIN:g}): sbatch --signal=USR1@{self.lead_s}"
               + ("" if self.lead_s <= 65535 else " (over Slurm's 65535 s: save more often, checkpoint.every)")]
        if self.expert_calls_s:
            out.append(f"of the training: {self.expert_calls_s:,.0f} s of one GEMM call per expert (SequentialMLP, "
                       f"{EXPERT_GEMM_CALL_S * 1e6:g} us each; TE's grouped experts make one per linear)")
        if self.overlapped:
            out.append(self.balance())
        out.append(f"the run (estimate): {self.steps:,} iterations and {self.saves:,} saves in {_duration(self.run_s)}; "
                   f"checkpoints on disk: up to {self.disk_bytes / GIB:,.0f} GiB ({self.keep} kept + the one being "
                   "written)")
        return out


def _duration(seconds: float) -> str:
    """``3,600 s`` as ``1.0 h``, ``9 days`` as ``9.0 days``; under two minutes in seconds.

    >>> _duration(90), _duration(5400), _duration(9 * 86400)
    ('90 s', '1.5 h', '9.0 days')
    """
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
    return f"{seconds / 86400:.1f} days"


def generation_seconds(recipe, a, *, engines: int, rtp: int, gpu: str, dtype_bytes: int) -> float:
    """One draw of ``prompts_per_step x n`` responses, each at the full ``response_budget``, on ``engines``
    engines of ``rtp`` GPUs each (the module docstring's memory-bound decoding)."""
    from megatron_credit.planning.plan import kv_bytes_per_token, total_param_count

    hbm = GPU_SPEEDS[gpu][1]
    r = recipe.rollout
    prompt, response, sequences = recipe.data.max_prompt_len, recipe.response_budget, r.prompts_per_step * r.n
    kv_read = sequences / max(engines, 1) * (prompt * response + response * response / 2) * kv_bytes_per_token(
        a, tp=rtp, dtype_bytes=dtype_bytes)  # per engine GPU, over the whole generation
    weights_read = response * total_param_count(a) * dtype_bytes / rtp
    return (kv_read + weights_read) / (hbm * DECODE_EFFICIENCY)


def checkpoint_size(recipe, hf_config) -> int:
    """Bytes of one save: the weights, fp32 master weights (when the parameters are not fp32) and Adam's two
    moments, of the actor and a separate critic; with LoRA the adapters and their moments instead of the actor."""
    from megatron_credit.planning.plan import DTYPE_BYTES, Architecture, _critic_params, _dtype_name, total_param_count

    a = Architecture.from_hf(hf_config)
    params = total_param_count(a)
    dtype_bytes = DTYPE_BYTES[_dtype_name(recipe, hf_config)]
    critic, _ = _critic_params(recipe, a, actor_params=params)
    lora = recipe.model.lora
    if lora.enabled:  # the adapters (fp32, with their two moments) and a critic's head; the base is named only
        from megatron_credit.planning.architecture import lora_layer_param_count

        adapters = a.num_layers * lora_layer_param_count(a, rank=lora.rank, targets=lora.targets)
        return int(adapters * (4 + 8) + critic * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 8))
    return int((params + critic) * (dtype_bytes + (4 if dtype_bytes < 4 else 0) + 8))


def sequential_expert_seconds(recipe, a, *, trainer_world: int, ep: int, passes: int, separate: bool) -> float:
    """``SequentialMLP``'s per-expert GEMM calls over one iteration's training on one rank (the module
    docstring): 0 for a dense model or TE's grouped experts. ``passes``: the forward-only passes (old
    log-probs, reference, a separate critic's values); ``separate``: a separate critic trains too."""
    from megatron_credit.planning.experts import expert_gemm_calls, expert_module
    from megatron_credit.planning.plan import _micro_batch_tokens

    moe = a.moe
    if moe is None or expert_module(grouped_gemm=recipe.moe.grouped_gemm,
                                    transformer_impl=recipe.model.transformer_impl) == "TEGroupedMLP":
        return 0.0
    p, t, r = recipe.parallel, recipe.train, recipe.rollout
    seq = recipe.data.max_prompt_len + recipe.response_budget
    dp = max(trainer_world // p.model_parallel_size, 1)
    micro_batches = math.ceil(r.prompts_per_step * r.n * seq / (dp * _micro_batch_tokens(recipe, seq=seq)))
    forward = expert_gemm_calls(moe, ep=ep, grouped=False)
    forwards = 2 if t.recompute == "full" else 1
    actor = forwards * forward + (1 if recipe.model.lora.enabled else 2) * forward  # LoRA: experts frozen
    calls = passes * forward + t.epochs * (actor + separate * (forwards + 2) * forward)
    return micro_batches * (a.num_layers // p.pipeline_model_parallel_size) * calls * EXPERT_GEMM_CALL_S


def iteration_estimate(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
                       disk_bytes_per_s: float = DISK_BYTES_PER_S, network_gbps: float | None = None,
                       ep: int | None = None) -> IterationEstimate:
    """The module docstring's estimate for ``recipe`` on a launch of ``nodes x gpus_per_node`` GPUs of kind
    ``gpu``: with ``rollout.ranks``, the last that-many GPUs are the pool's and the trainer's are the rest
    (the same split as ``planning.pool``), and the pool's update is planned at ``network_gbps``. ``ep``: an
    MoE model's expert-parallel size (default ``parallel.expert_model_parallel_size``)."""
    from megatron_credit.planning.plan import DTYPE_BYTES, Architecture, _critic_params, _dtype_name, total_param_count
    from megatron_credit.planning.architecture import active_param_count
    from megatron_credit.planning.pool import NETWORK_GBPS, update_seconds

    if gpu not in GPU_SPEEDS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPU_SPEEDS)}")
    if not disk_bytes_per_s > 0:
        raise ValueError(f"the disk bandwidth must be > 0, got {disk_bytes_per_s}")
    peak = GPU_SPEEDS[gpu][0]
    a = Architecture.from_hf(hf_config)
    r, t, ck = recipe.rollout, recipe.train, recipe.checkpoint
    world, params = nodes * gpus_per_node, total_param_count(a)
    pool = r.ranks if 0 < r.ranks < world else 0
    trainer_world = world - pool
    dtype_bytes = DTYPE_BYTES[_dtype_name(recipe, hf_config)]
    critic, separate = _critic_params(recipe, a, actor_params=params)
    prompt, response, sequences = recipe.data.max_prompt_len, recipe.response_budget, r.prompts_per_step * r.n

    rtp = int(dict(r.engine_options).get("tensor_parallel_size", 1) or 1)
    engines = max((pool or world) // rtp, 1)  # a pool's engines, or every GPU's share of one (sync)
    generation_s = generation_seconds(recipe, a, engines=engines, rtp=rtp, gpu=gpu, dtype_bytes=dtype_bytes)
    update_s = 0.0
    if pool:
        update_s = update_seconds(params * dtype_bytes, engines=engines, trainer_world=trainer_world,
                                  network_gbps=network_gbps or NETWORK_GBPS)

    seq = prompt + response
    attention = 2 * a.num_layers * seq * a.num_heads * a.head_dim  # causal QK^T and AV, per token, mean context
    linears, attention = 2 * active_param_count(a) * sequences * seq, attention * sequences * seq
    forward = linears + attention
    passes = 1 + (recipe.algorithm.kl_coef > 0) + separate  # old log-probs, reference, a separate critic's values
    forwards = 2 if t.recompute == "full" else 1
    step = forwards * forward + 2 * forward  # a backward: input and weight gradients, one forward each
    # LoRA: the base is frozen, so its linears' backward computes input gradients only
    actor_step = forwards * forward + linears + 2 * attention if recipe.model.lora.enabled else step
    training_s = (forward * passes + t.epochs * (actor_step + separate * step)) / (trainer_world * peak * TRAIN_MFU)
    expert_calls_s = sequential_expert_seconds(recipe, a, trainer_world=trainer_world, passes=passes,
                                               separate=bool(separate),
                                               ep=ep or recipe.parallel.expert_model_parallel_size)
    training_s += expert_calls_s

    checkpoint_bytes = checkpoint_size(recipe, hf_config)
    save_s = checkpoint_bytes / (math.ceil(trainer_world / gpus_per_node) * disk_bytes_per_s)  # the trainer's nodes write
    overlapped = bool(pool) and r.max_staleness >= 1
    saves = (t.steps // ck.every if ck.every else 0) + (1 if ck.save_at_end and (not ck.every or t.steps % ck.every) else 0)
    estimate = IterationEstimate(generation_s=generation_s, training_s=training_s, update_s=update_s,
                                 expert_calls_s=expert_calls_s, overlapped=overlapped, save_s=save_s,
                                 checkpoint_bytes=int(checkpoint_bytes), steps=t.steps, saves=saves, keep=ck.keep, lead_s=0)
    lead = math.ceil((estimate.iteration_s + save_s) * MARGIN / 60) * 60
    return dataclasses.replace(estimate, lead_s=max(lead, 60))
