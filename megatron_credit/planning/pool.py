"""The plan of a rollout pool (``rollout.ranks: N``, ``rollout.mode: one_step_off | async``): the engines'
GPUs apart from the trainer's, the weight update over the network, and the bytes each iteration moves.

A launch of ``nodes x gpus_per_node`` GPUs whose last ``N`` are the pool: the trainer is planned on the
first ``world - N`` (:func:`trainer_gpus`; ``planning.plan.plan`` then counts no engine on them), the pool
here (:func:`plan_pool`):

* **an engine GPU** holds the engine's share (``plan._rollout_share``: vLLM's ``gpu_memory_utilization`` x
  GPU, or the ``hf`` engine's weights and KV cache), a CUDA context per process on it (the pool rank's, and a
  multiprocess vLLM worker's), and the weight bucket in flight (received on the device, then staged in
  pinned host memory: ``sources/bridge.py``). The engine's KV cache must hold one full sequence.
* **the weight update**: a version (every parameter, in the model's dtype) to each engine, from trainer
  rank ``e mod T``: the engines' sends run in parallel over the trainer's ranks, each rank's one after the
  other, at ``network_gbps`` per GPU (the trainer blocks while it sends). Each engine's node holds a staged
  version in pinned host memory.
* **the samples**: each iteration's ``prompts_per_step x n`` samples once, at most ``4 (P + R) + 4 R + 52``
  bytes each (``rollout/wire.py``: int32 ids, float32 log-probs, the header) at the longest prompt and
  response, to the replicas' heads (``/ DP`` each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_credit.gpu_kinds import GIB, GPUS

NETWORK_GBPS = 400.0
"""The network bandwidth per GPU the update time is planned at, in Gbit/s (one 400G NIC per GPU, as on
H100 / H200 nodes); ``tools/plan.py --network-gbps`` states another."""
BUCKET_BYTES = 1 << 28
"""The weight bucket in flight on an engine's device (``Actor.hf_weight_buckets``' default)."""
STAGING_BANKS = 2
"""Versions an engine leader's ring holds at once (``sources/staging.py``): the one received or loaded, and at
most one staged."""
SAMPLE_HEADER_BYTES = 52
"""``rollout/wire.py``'s header per sample."""


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """The result of :func:`plan_pool` (bytes, seconds)."""

    ranks: int
    engines: int
    gpus_per_engine: int
    trainer_world: int
    engine_gpu_bytes: int
    """One engine GPU's peak: the engine's share + CUDA contexts + a bucket in flight."""
    engine_note: str
    kv_tokens: int
    gpu_bytes: int
    weight_bytes: int
    """One version of the weights (what each engine receives per update)."""
    update_s: float
    """How long the trainer sends a version to every engine at :attr:`network_gbps`."""
    network_gbps: float
    staging_host_bytes: int
    """Pinned host memory of a staged version, per engine."""
    sample_bytes: int
    """At most this many bytes of samples per iteration (all replicas)."""
    sample_bytes_per_head: int
    problems: tuple

    @property
    def fits(self) -> bool:
        return not self.problems and self.engine_gpu_bytes <= self.gpu_bytes

    def lines(self) -> list[str]:
        out = [f"rollout pool: the last {self.ranks} of the launch's ranks, {self.engines} engine(s) x "
               f"{self.gpus_per_engine} GPU(s); the trainer on the first {self.trainer_world}",
               f"{'engine GPU':<16}{self.engine_gpu_bytes / GIB:>9.2f}  {self.engine_note}; + CUDA contexts + a "
               f"{BUCKET_BYTES >> 20} MiB weight bucket in flight (of {self.gpu_bytes / GIB:.2f} GiB)",
               f"{'weight update':<16}{self.weight_bytes / GIB:>9.2f}  GiB per version to each engine; "
               f"{self.update_s:.1f} s for all {self.engines} at {self.network_gbps:g} Gb/s per GPU (trainer rank e mod "
               f"{self.trainer_world} sends engine e); {self.staging_host_bytes / GIB:.1f} GiB pinned host memory "
               "per engine (the staged version)",
               f"{'samples':<16}{self.sample_bytes / GIB:>9.3f}  GiB per iteration at most (each sample once), "
               f"{self.sample_bytes_per_head / GIB:.3f} per replica head"]
        out += [f"layout error: {p}" for p in self.problems]
        if self.fits:
            out.append(f"pool verdict: FITS (engine GPU {self.engine_gpu_bytes / GIB:.1f} of {self.gpu_bytes / GIB:.1f} "
                       f"GiB, {100 * self.engine_gpu_bytes / self.gpu_bytes:.0f}%)")
        else:
            out.append(f"pool verdict: DOES NOT FIT: {self.refusal()}")
        return out

    def refusal(self) -> str:
        """Why the engines do not fit, in one line."""
        if self.problems:
            return self.problems[0]
        return (f"rollout pool: an engine GPU needs {self.engine_gpu_bytes / GIB:.1f} GiB of {self.gpu_bytes / GIB:.1f} "
                "(lower rollout.engine_options.gpu_memory_utilization, or raise its tensor_parallel_size)")


def update_seconds(weight_bytes: int, *, engines: int, trainer_world: int, network_gbps: float) -> float:
    """How long the trainer sends one version of ``weight_bytes`` to every engine: trainer rank ``e mod T``
    sends engine ``e``, the ranks in parallel and each rank's engines one after the other, at
    ``network_gbps`` Gbit/s per GPU (the one model of the update, shared with ``planning.timing``)."""
    return weight_bytes * math.ceil(engines / max(trainer_world, 1)) / (network_gbps * 1e9 / 8)


def host_block_bytes(nbytes: int) -> int:
    """The bytes torch's pinned host allocator (``CachingHostAllocator``) holds for a request of ``nbytes``: the
    next power of two (its default: ``PYTORCH_CUDA_ALLOC_CONF``'s ``pinned_max_round_threshold`` unset).

    >>> [host_block_bytes(n) for n in (0, 1, 4096, 4097, 975_175_680)]
    [0, 1, 4096, 8192, 1073741824]
    """
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def trainer_gpus(recipe, *, nodes: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of the trainer in a launch whose last ``rollout.ranks`` GPUs are the pool: whole
    nodes when the pool fills nodes of its own, else one group of the trainer's GPUs."""
    pool = recipe.rollout.ranks
    if pool % gpus_per_node == 0 and pool < nodes * gpus_per_node:
        return nodes - pool // gpus_per_node, gpus_per_node
    return 1, max(nodes * gpus_per_node - pool, 1)


def plan_pool(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
              network_gbps: float = NETWORK_GBPS) -> PoolPlan:
    """The pool's plan in a launch of ``nodes x gpus_per_node`` GPUs of kind ``gpu`` (module docstring)."""
    from megatron_credit.planning.architecture import Architecture, total_param_count
    from megatron_credit.planning.plan import CUDA_CONTEXT_BYTES, DTYPE_BYTES, _dtype_name, _rollout_share

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPUS)}")
    r, p = recipe.rollout, recipe.parallel
    world, pool, rtp = nodes * gpus_per_node, r.ranks, r.tensor_parallel_size
    problems = []
    if pool >= world:
        problems.append(f"rollout.ranks={pool} must leave at least one trainer rank of the {world} GPUs")
    if pool % rtp:
        problems.append(f"rollout.ranks={pool} must be a multiple of rollout.engine_options.tensor_parallel_size={rtp}")
    if gpus_per_node % rtp:
        problems.append(f"rollout.engine_options.tensor_parallel_size={rtp} does not divide gpus_per_node="
                        f"{gpus_per_node} (an engine's GPUs are on one node)")
    trainer_world = max(world - pool, 1)
    engines = max(pool // rtp, 1)
    a = Architecture.from_hf(hf_config)
    wb = DTYPE_BYTES[_dtype_name(recipe, hf_config)]
    seq = recipe.data.max_prompt_len + recipe.response_budget
    gpu_bytes = GPUS[gpu]
    share, kv_tokens, note = _rollout_share(recipe, a, gpu_bytes=gpu_bytes, dtype_bytes=wb, engines=engines, rtp=rtp,
                                            seq=seq)
    contexts = 2 if r.engine == "vllm" else 1
    engine_gpu = share + contexts * CUDA_CONTEXT_BYTES + BUCKET_BYTES
    if kv_tokens < seq:
        problems.append(f"rollout pool: an engine's KV cache holds {kv_tokens} tokens, less than one {seq}-token "
                        "sequence (raise rollout.engine_options.gpu_memory_utilization or its tensor_parallel_size)")
    weight_bytes = total_param_count(a) * wb
    update_s = update_seconds(weight_bytes, engines=engines, trainer_world=trainer_world, network_gbps=network_gbps)
    response, prompt = recipe.response_budget, recipe.data.max_prompt_len
    samples = r.prompts_per_step * r.n * (4 * (prompt + response) + 4 * response + SAMPLE_HEADER_BYTES)
    dp = max(trainer_world // p.model_parallel_size, 1)
    return PoolPlan(ranks=pool, engines=engines, gpus_per_engine=rtp, trainer_world=trainer_world,
                    engine_gpu_bytes=engine_gpu, engine_note=note, kv_tokens=kv_tokens, gpu_bytes=gpu_bytes,
                    weight_bytes=weight_bytes, update_s=update_s, network_gbps=network_gbps,
                    staging_host_bytes=weight_bytes, sample_bytes=samples, sample_bytes_per_head=samples // dp,
                    problems=tuple(problems))
