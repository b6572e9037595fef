"""The plan of a rollout pool (``rollout.ranks: N``, ``rollout.mode: one_step_off | async``): the engines'
GPUs apart from the trainer's, the weight update over the network, and the bytes each iteration moves.

A launch of ``nodes x gpus_per_node`` GPUs whose last ``N`` are the pool: the trainer is planned on the
first ``world - N`` (:func:`trainer_gpus`; ``planning.plan.plan`` then counts no engine on them), the pool
here (:func:`plan_pool`):

* **an engine GPU** holds the engine's share (``plan._rollout_share``: vLLM's ``gpu_memory_utilization`` x
  GPU, or the ``hf`` engine's weights and KV cache), a CUDA context per process on it (the pool rank's, and a
  multiprocess vLLM worker's), and the largest weight bucket in flight (received on the device, then
  staged in pinned host memory: ``sources/bridge.py``; vLLM's load puts a bucket on that GPU again for its
  workers, and the two overlap: the receipt runs beside the engine). The engine's KV cache must hold one
  full sequence.
* **the weight update**: a version (every parameter, in the model's dtype) to each engine, from trainer
  rank ``e mod T``: the engines' sends run in parallel over the trainer's ranks, each rank's one after the
  other, at ``network_gbps`` per GPU (the trainer blocks while it sends).
* **pinned host memory** per engine (its leader's ring, ``sources/staging.py``): :data:`STAGING_BANKS`
  versions, each bucket (:func:`weight_buckets`: whole sync groups, a decoder layer at 32B, 0.91 GiB) in a
  chunk of the next power of two (:func:`host_block_bytes`, as torch's pinned allocator rounds it).
* **the samples**: each iteration's ``prompts_per_step`` groups of ``n`` samples once, at the longest prompt
  and response (:func:`wire_bytes`, ``rollout/wire.py``: int32 ids, float32 log-probs, the headers, an MoE
  engine's routing when the trainer replays it, a trajectory's turns), to the replicas' heads (``/ DP`` each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_credit.gpu_kinds import GIB, GPUS

NETWORK_GBPS = 400.0
"""The network bandwidth per GPU the update time is planned at, in Gbit/s (one 400G NIC per GPU, as on
H100 / H200 nodes); ``tools/plan.py --network-gbps`` states another."""
BUCKET_BYTES = 1 << 28
"""``Actor.hf_weight_buckets``' ``bucket_bytes``: a bucket closes before a sync group whose first tensor would
take it past this many bytes, so a group larger than it (a decoder layer of a large model) is a bucket of its
own (:func:`weight_buckets`)."""
STAGING_BANKS = 2
"""Versions an engine leader's ring holds at once (``sources/staging.py``): the one received or loaded, and at
most one staged."""
SAMPLE_HEADER_BYTES = 57
"""``rollout/wire.py``'s bytes per sample besides its tokens: 9 int32 header words, 2 float64 timings, and its
group's reward (float32) and verdict (uint8) of it."""
GROUP_HEADER_BYTES = 24
"""``rollout/wire.py``'s bytes per group of samples besides its samples (its key, count and kind words, and the
message's item count), at most."""


def wire_bytes(prompt: int, response: int, *, n: int, routed: tuple[int, int] = (0, 0), turns: int = 0) -> int:
    """The bytes of a group of ``n`` samples of ``prompt`` and ``response`` tokens on ``rollout/wire.py``: ids
    (int32) and log-probs (float32), with ``routed = (MoE layers, top_k)`` their routing (int16 per token,
    layer and expert), with ``turns`` a trajectory's turn codes (int16 per response token), turn rewards
    (float32) and counts (4 int32).

    >>> wire_bytes(10, 20, n=2), wire_bytes(10, 20, n=2, routed=(3, 2), turns=2)
    (538, 1386)
    """
    per = 4 * (prompt + response) + 4 * response + SAMPLE_HEADER_BYTES
    per += 2 * (prompt + response) * routed[0] * routed[1]
    if turns:
        per += 2 * response + 4 * turns + 16
    return n * per + GROUP_HEADER_BYTES


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """The result of :func:`plan_pool` (bytes, seconds)."""

    ranks: int
    engines: int
    gpus_per_engine: int
    trainer_world: int
    engine_gpu_bytes: int
    """One engine GPU's peak: the engine's share + CUDA contexts + the weight buckets in flight."""
    engine_note: str
    kv_tokens: int
    gpu_bytes: int
    weight_bytes: int
    """One version of the weights (what each engine receives per update)."""
    update_s: float
    """How long the trainer sends a version to every engine at :attr:`network_gbps`."""
    network_gbps: float
    largest_bucket_bytes: int
    """The largest weight bucket of a version (:func:`weight_buckets`)."""
    buckets_in_flight: int
    """Weight buckets on an engine's first GPU at once: the one received, and vLLM's copy of the one loaded."""
    buckets: int
    """Weight buckets per version."""
    staging_host_bytes: int
    """Pinned host memory per engine: :data:`STAGING_BANKS` versions, each bucket rounded up to a power of two
    (:func:`staging_host_bytes`)."""
    engines_per_node: int
    """Engines on one node (GPUs per node / rollout TP): the pinned host memory of a pool node is theirs."""
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
               f"{'engine GPU':<16}{self.engine_gpu_bytes / GIB:>9.2f}  {self.engine_note}; + CUDA contexts + "
               f"{self.buckets_in_flight} weight bucket(s) of {self.largest_bucket_bytes / GIB:.2f} GiB in flight "
               f"(of {self.gpu_bytes / GIB:.2f} GiB)",
               f"{'weight update':<16}{self.weight_bytes / GIB:>9.2f}  GiB per version to each engine; "
               f"{self.update_s:.1f} s for all {self.engines} at {self.network_gbps:g} Gb/s per GPU (trainer rank e mod "
               f"{self.trainer_world} sends engine e)",
               f"{'pinned host':<16}{self.staging_host_bytes / GIB:>9.2f}  GiB per engine: {STAGING_BANKS} versions "
               f"(one received or loaded, one staged) of {self.buckets} buckets, each rounded up to a power of two "
               f"(largest {self.largest_bucket_bytes / GIB:.2f} GiB); "
               f"{self.staging_host_bytes * self.engines_per_node / GIB:.1f} GiB per node of {self.engines_per_node}",
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


def weight_buckets(a, *, dtype_bytes: int, bucket_bytes: int = BUCKET_BYTES) -> list[int]:
    """The bytes of each weight bucket of one version, in the order the trainer sends them
    (``rollout.weight_sync.group_buckets`` over ``conversion.live.iter_hf_weight_buckets``' HF tensors): the
    sync groups are the embedding, each decoder layer (its first tensor the input norm, ``h`` elements), the
    final norm and an untied output layer; a bucket closes before a group whose first tensor would take it
    past ``bucket_bytes``. A tensor is padded to 16 bytes in the bucket (``sources/bucket_bytes.py``): none
    is when its elements fill 16-byte rows, as at every width that is a multiple of 8 in a 2-byte dtype.

    >>> from megatron_credit.planning.architecture import Architecture
    >>> arch = Architecture(model_type="qwen2", hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
    ...                     head_dim=128, intermediate_size=27648, vocab_size=152064, tied_embeddings=False,
    ...                     max_position_embeddings=32768)  # Qwen2.5-32B
    >>> b = weight_buckets(arch, dtype_bytes=2)
    >>> len(b), b[0], b[1], b[-2:]  # the embedding, a layer, the final norm, the output layer: each alone
    (67, 1557135360, 975210496, [10240, 1557135360])
    """
    from megatron_credit.planning.architecture import layer_param_count

    h, emb = a.hidden_size * dtype_bytes, a.vocab_size * a.hidden_size * dtype_bytes
    layer = layer_param_count(a) * dtype_bytes
    groups = [(emb, emb)] + [(h, layer)] * a.num_layers + [(h, h)] + ([] if a.tied_embeddings else [(emb, emb)])
    out: list[int] = []
    for first, nbytes in groups:  # (its first tensor's bytes, the group's)
        if not out or out[-1] + first > bucket_bytes:
            out.append(0)
        out[-1] += nbytes
    return out


def staging_host_bytes(buckets: list[int], *, banks: int = STAGING_BANKS) -> int:
    """Pinned host memory of an engine leader's ring (``sources/staging.py``): ``banks`` versions of one chunk
    per bucket, each the allocator's power of two.

    >>> staging_host_bytes([1557135360] + [975210496] * 64 + [10240, 1557135360]) / 2 ** 30  # 32B: 2 x 68 GiB
    136.00003051757812
    """
    return banks * sum(host_block_bytes(b) for b in buckets)


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
    buckets = weight_buckets(a, dtype_bytes=wb)
    in_flight = 2 if r.engine == "vllm" else 1  # the hf engine copies from host memory into its weights
    engine_gpu = share + contexts * CUDA_CONTEXT_BYTES + in_flight * max(buckets)
    if kv_tokens < seq:
        problems.append(f"rollout pool: an engine's KV cache holds {kv_tokens} tokens, less than one {seq}-token "
                        "sequence (raise rollout.engine_options.gpu_memory_utilization or its tensor_parallel_size)")
    weight_bytes = total_param_count(a) * wb
    update_s = update_seconds(weight_bytes, engines=engines, trainer_world=trainer_world, network_gbps=network_gbps)
    response, prompt = recipe.response_budget, recipe.data.max_prompt_len
    # an MoE engine returns its routing when the trainer replays it (moe.routing_replay: rollout)
    routed = (a.num_layers, a.top_k) if a.moe is not None and recipe.moe.routing_replay == "rollout" else (0, 0)
    samples = r.prompts_per_step * wire_bytes(prompt, response, n=r.n, routed=routed,
                                              turns=recipe.env.max_turns if recipe.env.enabled else 0)
    dp = max(trainer_world // p.model_parallel_size, 1)
    return PoolPlan(ranks=pool, engines=engines, gpus_per_engine=rtp, trainer_world=trainer_world,
                    engine_gpu_bytes=engine_gpu, engine_note=note, kv_tokens=kv_tokens, gpu_bytes=gpu_bytes,
                    weight_bytes=weight_bytes, update_s=update_s, network_gbps=network_gbps,
                    largest_bucket_bytes=max(buckets), buckets_in_flight=in_flight, buckets=len(buckets),
                    staging_host_bytes=staging_host_bytes(buckets), engines_per_node=max(gpus_per_node // rtp, 1),
                    sample_bytes=samples, sample_bytes_per_head=samples // dp,
                    problems=tuple(problems))
