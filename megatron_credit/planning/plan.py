"""The memory planner: does a recipe's layout fit its cluster? (``tools/plan.py``, ``pretrain_rl.py --dry-run``)

Everything here is arithmetic on the model's architecture numbers and the recipe; nothing is built and
no GPU is needed. :func:`plan` checks the layout (heads and query groups by TP, layers by PP, sequence
lengths by ``2*CP`` (``2*CP*TP`` with sequence parallelism), the world size by TP x PP x CP, the batch
by DP) and estimates the peak memory of one GPU, term by term:

* **weights** of the largest pipeline stage's shard (:func:`stage_param_counts`; the first stage holds
  the embedding, the last the output layer, a tied output is a second copy on the last stage when PP > 1;
  a mixture-of-experts layer holds the router and ``E / EP`` experts over the expert TP,
  ``planning/experts.py``);
* **gradients** in fp32 (megatron's main gradients, 4 bytes per parameter);
* **optimizer states**: fp32 master weights (when the parameters are not fp32) and Adam's two moments,
  divided over DP x CP with the distributed optimizer (``cluster.distributed_optimizer``), the routed
  experts' over the expert data-parallel group ``world / (ETP x EP x PP)``. Both numbers are printed. This is megatron's mixed-precision scheme; the trainer's CPU path (``torch.optim.AdamW``
  on the parameters' own dtype, README "Not yet in the trainer") uses less, so the plan is conservative;
* **activations** of the longest micro-batch (:func:`activation_bytes`): one micro-batch holds
  ``max(train.max_tokens_per_microbatch, prompt + response)`` tokens, split over CP; under 1F1B the first
  stage keeps PP micro-batches in flight of L/PP layers each, i.e. L layers' worth; an MoE layer keeps
  its all-to-all dispatched token copies and experts' outputs instead of the dense MLP's (the same for TE's
  grouped experts and megatron's ``SequentialMLP``, whichever the recipe gets: the note names it);
* **log-prob chunk**: fp32 logits of one ``train.logprob_chunk_size`` chunk over V/TP, three copies
  (logits, softmax, gradient);
* **reference model** weights when ``algorithm.kl_coef > 0``; the **critic** (PPO's value head, CompPO's
  critic bounded at 0.5 % of the actor) with its gradient and optimizer, or PPO's separate value model
  (``algorithm.params.critic: separate``): the actor's weights, gradients and optimizer states again;
* **rollout engine**: every GPU generates. The world is cut into ``world / rollout TP`` engines
  (rollout TP: ``rollout.engine_options.tensor_parallel_size``, default 1, whatever the trainer's
  TP/PP/CP/DP), each on a contiguous group of rollout-TP GPUs of one node. vLLM takes
  ``gpu_memory_utilization`` x GPU memory on each of its GPUs (its weights over the rollout TP plus a KV
  cache filling the rest); the ``hf`` engine is one full model copy and the KV cache of its share of the
  batch, on the first GPU of its group;
* **NCCL buffers** of the groups the layout makes (:mod:`.nccl`) and a fixed **reserve** for allocator slack;
* **CUDA contexts**: one per process per GPU it touches (:data:`CUDA_CONTEXT_BYTES`): the trainer
  rank's own, plus the vLLM worker's on the same GPU (a multiprocess engine; the ``hf`` engine and an
  in-process vLLM live in the trainer's process). The worker lives on while the engine sleeps, so both
  phases count it.

Training and rollout alternate, so the peak is the larger of two phases, with ``resident`` the weights,
gradients, optimizer, critic, reference, NCCL buffers, reserve and CUDA contexts:

* training peak = ``resident + activations + log-prob chunk`` (the engine sleeps at level 2: its
  weights and KV cache are released, the weights re-synced every iteration);
* rollout peak = ``resident - offloaded + rollout engine``. Before an engine wakes the trainer moves the
  optimizer states and the fp32 gradient buffers to pinned host memory (:attr:`Plan.offload_bytes` per
  GPU, printed per node too) and empties the allocator's cache, so neither those nor the last step's
  cached activations stay on the GPU. The critic's gradients and optimizer states are counted as staying
  (an upper bound); the optimizer step is fused Adam, which keeps no per-parameter temporaries.

>>> arch = Architecture(model_type="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
...                     head_dim=16, intermediate_size=128, vocab_size=128, tied_embeddings=False,
...                     max_position_embeddings=256)
>>> layer_param_count(arch)  # qkv 64*128 + bias 128, proj 64*64, mlp 3*64*128, two norms 2*64
37120
>>> total_param_count(arch)  # 2 layers + embedding + output + final norm
90688
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_credit.planning.architecture import (Architecture, activation_bytes,  # noqa: F401 (re-exported)
                                                   activation_bytes_per_token_layer, kv_bytes_per_token,
                                                   layer_param_count, stage_expert_param_count,
                                                   stage_param_counts, total_param_count)
from megatron_credit.planning.experts import expert_data_parallel_size, expert_layout_problems, expert_module
from megatron_credit.gpu_kinds import GIB, GPUS  # noqa: F401  (re-exported: planning.GPUS)
from megatron_credit.planning.nccl import group_buffer_bytes, nccl_buffer_bytes

RESERVED_BYTES = 2 * GIB
"""Allocator fragmentation and NCCL's buffers that :mod:`.nccl` does not count (LL / LL128, NVLS), per GPU (2 GiB:
the 3.5 GiB flat reserve less the ~1.5 GiB of NCCL buffers it held, now counted per group)."""

CUDA_CONTEXT_BYTES = GIB // 2
"""One process's CUDA context on one GPU: the driver's state and the kernels torch, cuBLAS and NCCL load.
~0.5 GiB is the order nvidia-smi shows for a process that has only created its context on an 80 GB
Ampere/Hopper GPU (it varies with the CUDA version and lazy module loading); an estimate, not measured
by this project."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

from megatron_credit.planning.known_architectures import KNOWN_ARCHITECTURES  # noqa: E402


def known_architecture(name_or_path: str) -> Optional[Mapping[str, Any]]:
    """The :data:`KNOWN_ARCHITECTURES` row of a hub id or a folder named after one (case-insensitive).

    >>> known_architecture("/models/qwen2.5-32b")["hidden_size"], known_architecture("gpt2") is None
    (5120, True)
    """
    wanted = name_or_path.rstrip("/").lower()
    for key, row in KNOWN_ARCHITECTURES.items():
        if wanted == key.lower() or os.path.basename(wanted) == key.split("/")[-1].lower():
            return row
    return None


def resolve_hf_config(model):
    """The ``transformers`` config of a recipe's ``model`` section: the checkpoint's when
    ``model.name_or_path`` is a folder with a ``config.json`` or the section is inline, else the
    :data:`KNOWN_ARCHITECTURES` row of that name (with the section's context / RoPE overrides)."""
    path = model.name_or_path
    if path is None or os.path.isfile(os.path.join(path, "config.json")):
        return model.hf_config()
    row = known_architecture(path)
    if row is None:
        raise ValueError(f"model.name_or_path={path!r} is not a folder with a config.json and not one of the "
                         f"planner's known architectures {sorted(KNOWN_ARCHITECTURES)}")
    return dataclasses.replace(model, name_or_path=None, architecture=dict(row)).hf_config()


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The result of :func:`plan`: layout problems (empty when valid), memory terms in bytes, the verdict."""

    layout: Mapping[str, int]
    """tp, pp, cp, dp, world; and ep, etp, edp (expert data-parallel) for a mixture-of-experts model."""
    problems: tuple
    """Layout errors, each naming the recipe field to change."""
    terms: Mapping[str, int]
    """Per-GPU bytes by term (see the module docstring)."""
    notes: Mapping[str, str]
    """A short explanation per term."""
    optimizer_bytes_other: int
    """Optimizer states under the other distributed-optimizer choice."""
    train_peak: int
    """Resident terms + activations + log-prob chunk."""
    rollout_peak: int
    """Resident terms - offloaded terms + rollout engine."""
    gpu_bytes: int
    """Memory of one GPU."""
    kv_tokens: int
    """Tokens one rollout engine's KV cache holds (each of a vLLM engine's GPUs holds them all, for its
    share of the KV heads)."""
    engines: int
    """Rollout engines: world / rollout TP."""
    gpus_per_engine: int
    """Rollout TP: the contiguous GPUs of one node an engine owns."""
    offload_bytes: int
    """Pinned host bytes one GPU's rank offloads while the engine generates (optimizer + gradients)."""
    gpus_per_node: int
    """GPUs per node, for the host memory the offload needs per node."""
    pool_ranks: int = 0
    """``rollout.ranks``: the engines are a rollout pool's, not on these GPUs (``planning/pool.py``)."""

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.rollout_peak)

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak <= self.gpu_bytes

    @property
    def kv_tokens_per_gpu(self) -> int:
        """The cluster's KV cache (engines x :attr:`kv_tokens`) over its GPUs."""
        return self.engines * self.kv_tokens // self.layout["world"]

    @property
    def offload_bytes_per_node(self) -> int:
        return self.offload_bytes * self.gpus_per_node

    def largest_term(self) -> str:
        """The largest term of the phase with the larger peak (an offloaded term does not count in the
        rollout phase)."""
        skip = () if self.train_peak >= self.rollout_peak else TRAIN_ONLY + OFFLOADED
        return max((k for k in self.terms if k not in skip), key=self.terms.get)


RESIDENT = ("weights", "gradients", "optimizer", "critic", "reference", "nccl_buffers", "reserve", "cuda_contexts")
"""Terms on the GPU in both phases (less :data:`OFFLOADED` while the engine generates)."""
OFFLOADED = ("gradients", "optimizer")
"""Terms the trainer moves to pinned host memory before the engine wakes."""
TRAIN_ONLY = ("activations", "logprob_chunk")


def expert_sizes(recipe, *, ep: Optional[int] = None, etp: Optional[int] = None) -> tuple[int, int]:
    """(EP, expert TP): the arguments where given, else the recipe's ``parallel.expert_model_parallel_size``
    / ``parallel.expert_tensor_parallel_size`` (None: the TP size, megatron's default for the experts' TP)."""
    p = recipe.parallel
    ep = ep or p.expert_model_parallel_size
    etp = etp or p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    return ep, etp


def plan(recipe, hf_config, *, nodes: int, gpus_per_node: int, gpu: str,
         distributed_optimizer: Optional[bool] = None, ep: Optional[int] = None, etp: Optional[int] = None) -> Plan:
    """Check ``recipe``'s layout on ``nodes`` x ``gpus_per_node`` GPUs of kind ``gpu`` and estimate one
    GPU's peak memory (module docstring). ``distributed_optimizer`` defaults to what the run does
    (``optim.distributed_optimizer``, or ``cluster.distributed_optimizer``); ``ep`` / ``etp``, the
    expert-parallel and expert-TP sizes of an MoE model, to the recipe's (:func:`expert_sizes`)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPUS)}")
    if distributed_optimizer is None:
        distributed_optimizer = recipe.optim.distributed_optimizer or recipe.cluster.distributed_optimizer
    a = Architecture.from_hf(hf_config)
    p, r, t = recipe.parallel, recipe.rollout, recipe.train
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    world = nodes * gpus_per_node
    problems = recipe.problems(hf_config, world_size=world)  # the trainer's checks (Recipe.validate)
    dp = max(world // p.model_parallel_size, 1)
    seq = recipe.data.max_prompt_len + recipe.response_budget
    micro_tokens = _micro_batch_tokens(recipe, seq=seq)
    layout = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "world": world}
    ep, etp = expert_sizes(recipe, ep=ep, etp=etp)
    expert_problems = expert_layout_problems(num_experts=a.num_experts, world=world, tp=tp, pp=pp, ep=ep, etp=etp,
                                             sequence_parallel=p.sequence_parallel)
    problems += expert_problems
    edp = expert_data_parallel_size(world=world, ep=ep, etp=etp, pp=pp)
    if a.moe is not None:
        layout.update(ep=ep, etp=etp, edp=edp)
    if a.num_heads % tp or a.num_layers % pp or expert_problems:
        tp = pp = etp = ep = 1  # keep the arithmetic meaningful; the problem is reported above

    dtype = _dtype_name(recipe, hf_config)
    wb = DTYPE_BYTES[dtype]
    params = max(stage_param_counts(a, tp=tp, pp=pp, ep=ep, etp=etp))
    expert_params = stage_expert_param_count(a, pp=pp, ep=ep, etp=etp)
    optim_per_param = 8 + (4 if wb != 4 else 0)  # Adam m, v (+ fp32 master weights)

    def optimizer_bytes(sharded: bool) -> int:
        # megatron's distributed optimizer: dense parameters over DP x CP, experts over expert DP
        dense, experts = (params - expert_params) * optim_per_param, expert_params * optim_per_param
        return math.ceil(dense / (dp * cp)) + math.ceil(experts / edp) if sharded else dense + experts

    lora = recipe.model.lora
    adapters = 0
    if lora.enabled:  # the base frozen: gradients and Adam states of the fp32 adapters alone (models/lora.py)
        from megatron_credit.planning.architecture import lora_layer_param_count

        adapters = a.num_layers // pp * lora_layer_param_count(a, rank=lora.rank, targets=lora.targets, tp=tp)
        full_training = params * 4 + optimizer_bytes(distributed_optimizer) + (params * wb if recipe.algorithm.kl_coef > 0 else 0)

        def optimizer_bytes(sharded: bool) -> int:  # noqa: F811  (fp32 adapters: m and v, no master copy)
            return math.ceil(adapters * 8 / (dp * cp)) if sharded else adapters * 8

    optimizer, other = optimizer_bytes(distributed_optimizer), optimizer_bytes(not distributed_optimizer)
    critic_params, separate_critic = _critic_params(recipe, a, actor_params=params)
    local_tokens = math.ceil(micro_tokens / cp)
    local_attn = recipe.model.transformer_impl == "local"
    nccl = nccl_buffer_bytes(tp=tp, pp=pp, cp=cp, dp=dp, tied_embeddings=a.tied_embeddings)
    chunk = min(t.logprob_chunk_size, local_tokens)
    trained = adapters if lora.enabled else params
    terms = {
        "weights": params * wb + adapters * 4,
        "gradients": trained * 4,
        "optimizer": optimizer,
        # a separate value model: weights, fp32 gradients and optimizer sharded like the actor's
        "critic": (params * (wb + 4) + optimizer) if separate_critic else critic_params * (wb + 4 + optim_per_param),
        # LoRA: the reference is the policy with its adapters off, no copy
        "reference": params * wb if recipe.algorithm.kl_coef > 0 and not lora.enabled else 0,
        "activations": activation_bytes(a, tokens=local_tokens, tp=tp, sequence_parallel=p.sequence_parallel,
                                        recompute=t.recompute, dtype_bytes=wb, score_matrix=local_attn, etp=etp),
        "logprob_chunk": 3 * 4 * chunk * a.vocab_size // tp,
        "nccl_buffers": nccl[0],
        "reserve": RESERVED_BYTES,
    }
    gpu_bytes = GPUS[gpu]
    engines, rtp = _rollout_engines(recipe, nodes=nodes, gpus_per_node=gpus_per_node, problems=problems)
    contexts, contexts_note = _cuda_contexts(recipe)
    terms["cuda_contexts"] = contexts * CUDA_CONTEXT_BYTES
    engine, kv_tokens, engine_note = _rollout_share(recipe, a, gpu_bytes=gpu_bytes, dtype_bytes=wb, engines=engines,
                                                    rtp=rtp, seq=seq)
    if r.ranks:  # the engines are the rollout pool's, on GPUs of their own (planning/pool.py)
        contexts, contexts_note = 1, "the trainer rank's (no engine on its GPU)"
        terms["cuda_contexts"] = CUDA_CONTEXT_BYTES
        engine, engine_note = 0, f"none: the engines are the rollout pool's ({r.ranks} ranks of their own, planning/pool.py)"
    terms["rollout_engine"] = engine
    if kv_tokens < seq and not r.ranks:
        problems.append(f"rollout engine: its KV cache holds {kv_tokens} tokens, less than one "
                        f"{seq}-token sequence (raise rollout.engine_options.gpu_memory_utilization or its "
                        "tensor_parallel_size)")
    resident = sum(terms[k] for k in RESIDENT)
    offload = sum(terms[k] for k in OFFLOADED)
    form_note = "packed" if recipe.packing else "padded" + (", under PP to the largest shape: may exceed" if pp > 1 else "")
    notes = {
        "weights": f"{params / 1e6:,.1f}M params on the largest stage x {wb} B ({dtype})"
                   + (f", {expert_params / 1e6:,.1f}M of them experts ({a.num_experts // ep} of {a.num_experts} "
                      f"per layer: EP {ep}, expert TP {etp})" if a.moe else ""),
        "gradients": "fp32 main gradients, 4 B/param",
        "optimizer": (f"8 B/adapter param (Adam m, v of fp32 adapters)" if lora.enabled else
                      f"{optim_per_param} B/param (Adam m, v{' + fp32 master' if wb != 4 else ''})")
                     + (f" / DPxCP={dp * cp} (distributed optimizer)" if distributed_optimizer else
                        " (no distributed optimizer)")
                     + (f", experts / expert DP={edp}" if a.moe and distributed_optimizer else ""),
        "critic": (f"separate value model, {params / 1e6:,.1f}M params (weights, gradients, optimizer as the "
                   "actor's)") if separate_critic else f"{critic_params:,} params" if critic_params else "none",
        "reference": "frozen copy (algorithm.kl_coef > 0)" if terms["reference"] else
                     "none: the adapters off (LoRA)" if lora.enabled and recipe.algorithm.kl_coef > 0 else "none (no KL term)",
        "activations": f"{local_tokens:,} tokens/GPU (micro-batch {micro_tokens:,} / CP {cp}, {form_note}), "
                       f"recompute {t.recompute or 'none'}{', fp32 scores (local attention)' if local_attn else ''}"
                       + (f", MoE: top-{a.top_k} x {a.expert_ffn} per token, all-to-all dispatch, "
                          f"{expert_module(grouped_gemm=recipe.moe.grouped_gemm, transformer_impl=recipe.model.transformer_impl)}"
                          if a.moe else ""),
        "logprob_chunk": f"{chunk:,} tokens x V/TP={a.vocab_size // tp:,} fp32 x 3",
        "nccl_buffers": f"{', '.join(nccl[1]) or 'no'} group(s), {group_buffer_bytes(2, 2) >> 20} MiB or less each",
        "reserve": "allocator slack, NCCL's LL/LL128/NVLS buffers",
        "cuda_contexts": f"{contexts} x {CUDA_CONTEXT_BYTES / GIB:.1f} GiB: {contexts_note}",
        "rollout_engine": engine_note,
    }
    if lora.enabled:
        notes["weights"] += f" + {adapters / 1e6:,.2f}M fp32 adapter params (LoRA rank {lora.rank})"
        notes["gradients"] = (f"fp32 adapter gradients, 4 B/adapter param; the base frozen (LoRA saves "
                              f"{(full_training - terms['gradients'] - terms['optimizer'] - terms['reference']) / GIB:,.1f} "
                              "GiB of gradients, optimizer states and reference against full fine-tuning)")
    return Plan(layout=layout, problems=tuple(problems),
                terms=terms, notes=notes, optimizer_bytes_other=other,
                train_peak=resident + terms["activations"] + terms["logprob_chunk"],
                rollout_peak=resident - offload + terms["rollout_engine"], gpu_bytes=gpu_bytes, kv_tokens=kv_tokens,
                engines=engines, gpus_per_engine=rtp, offload_bytes=offload, gpus_per_node=gpus_per_node,
                pool_ranks=r.ranks)


def _rollout_engines(recipe, *, nodes: int, gpus_per_node: int, problems: list) -> tuple[int, int]:
    """(engines, rollout TP): every GPU generates, an engine on each contiguous group of rollout-TP GPUs
    of a node (``rollout.placement``). Appends to ``problems`` a rollout TP that splits a node (the
    recipe's own checks name one that does not divide the world)."""
    rtp = recipe.rollout.tensor_parallel_size
    if gpus_per_node % rtp:
        problems.append(f"rollout.engine_options.tensor_parallel_size={rtp} does not divide gpus_per_node="
                        f"{gpus_per_node} (an engine's GPUs are on one node)")
    return max(nodes * gpus_per_node // rtp, 1), rtp


def _cuda_contexts(recipe) -> tuple[int, str]:
    """(CUDA contexts on one GPU, why): the trainer rank's, plus a multiprocess vLLM worker's."""
    r = recipe.rollout
    opts = dict(r.engine_options)
    in_process = opts.get("weight_transfer") == "in_process" or opts.get("v1_multiprocessing") is False
    if r.engine == "vllm" and not in_process:
        return 2, "the trainer rank's + its vLLM worker's (its own process)"
    return 1, f"the trainer rank's (the {r.engine} engine runs in its process)"


def _micro_batch_tokens(recipe, *, seq: int) -> int:
    """Tokens of the longest micro-batch: ``max(train.max_tokens_per_microbatch, seq)`` padded up to a
    multiple of 2 x CP (x TP with sequence parallelism); padded rows under PP can hold more (the note)."""
    from megatron_credit.batch.context_parallel import required_multiple

    p = recipe.parallel
    # The trainer pads each micro-batch up to that multiple, so a budget that is not a multiple trains;
    # its peak is the budget rounded up.
    multiple = required_multiple(p.context_parallel_size, p.tensor_model_parallel_size, p.sequence_parallel)
    return -(-max(recipe.train.max_tokens_per_microbatch, seq) // multiple) * multiple


def _critic_params(recipe, a: Architecture, *, actor_params: int) -> tuple[int, bool]:
    """(the critic's parameters on one GPU, whether it is a separate value model) for the recipe's
    algorithm, given the actor's parameters on its largest stage."""
    kind = recipe.algorithm.build().critic_kind
    if kind is None:
        return 0, False
    if kind.separate_model:
        return actor_params, True  # a value model of the actor's architecture and layout
    if kind.actor_options is not None:
        return math.ceil(0.005 * actor_params), False  # a critic on the actor's detached features: < 0.5 % of it
    return a.hidden_size + 1, False  # a value head on the actor trunk


def _dtype_name(recipe, hf_config) -> str:
    if recipe.model.params_dtype != "auto":
        return recipe.model.params_dtype
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else "float32"
    return name if name in DTYPE_BYTES else "float32"


def _rollout_share(recipe, a: Architecture, *, gpu_bytes: int, dtype_bytes: int, engines: int, rtp: int,
                   seq: int) -> tuple[int, int, str]:
    """(bytes the engine takes on its busiest GPU, KV-cache tokens of one engine, a note)."""
    r = recipe.rollout
    opts = dict(r.engine_options)
    if r.engine == "vllm":
        util = float(opts.get("gpu_memory_utilization", 0.5))  # VLLMRolloutEngine's default
        share = int(util * gpu_bytes)
        weights = total_param_count(a) * dtype_bytes // rtp
        kv_tokens = max(share - weights, 0) // kv_bytes_per_token(a, tp=rtp, dtype_bytes=dtype_bytes)
        return share, kv_tokens, (f"vLLM {util:.2f} x GPU: weights {weights / GIB:.1f} GiB (TP {rtp}) + KV cache "
                                  f"{kv_tokens:,} tokens = {kv_tokens // seq} full-length sequences per engine")
    rows = r.max_batch_size or -(-r.prompts_per_step * r.n // engines)  # its share of the batch
    weights = total_param_count(a) * dtype_bytes
    per_token = kv_bytes_per_token(a, tp=1, dtype_bytes=dtype_bytes)
    kv = rows * seq * per_token
    where = f", on the first of its {rtp} GPUs" if rtp > 1 else ""
    return weights + kv, kv // per_token, (f"hf engine: weights {weights / GIB:.1f} GiB + KV of {rows} rows x "
                                           f"{seq:,} tokens{where}")


def format_plan(p: Plan, *, title: str = "") -> str:
    """The planner's table and verdict as text."""
    lay = p.layout
    lines = [title] if title else []
    experts = f" EP={lay['ep']} ETP={lay['etp']} EDP={lay['edp']}" if "ep" in lay else ""
    lines.append(f"layout TP={lay['tp']} PP={lay['pp']} CP={lay['cp']} DP={lay['dp']}{experts} (world {lay['world']})")
    if p.pool_ranks:
        lines.append(f"rollout: on a pool of {p.pool_ranks} ranks of its own (planned apart); none on these GPUs")
    else:
        lines.append(f"rollout {p.engines} engine(s) x {p.gpus_per_engine} GPU(s) (world {lay['world']} / "
                     f"rollout.engine_options.tensor_parallel_size {p.gpus_per_engine}): every GPU hosts a share of one")
    lines.append(f"{'term':<16}{'GiB':>9}  note")
    for name, value in p.terms.items():
        lines.append(f"{name:<16}{value / GIB:>9.2f}  {p.notes[name]}")
    lines.append(f"{'(optimizer alt)':<16}{p.optimizer_bytes_other / GIB:>9.2f}  optimizer states with the other "
                 "distributed-optimizer choice")
    if not p.pool_ranks:
        lines.append(f"{'KV cache':<16}{p.kv_tokens:>9,}  tokens per engine; {p.kv_tokens_per_gpu:,} per GPU "
                     f"({p.engines} engine(s) x {p.kv_tokens:,} / {lay['world']} GPUs)")
        lines.append(f"{'host offload':<16}{p.offload_bytes / GIB:>9.2f}  pinned host GiB per GPU while generating "
                     f"({'+'.join(OFFLOADED)}); {p.offload_bytes_per_node / GIB:.2f} GiB per node of {p.gpus_per_node}")
    lines.append(f"{'train peak':<16}{p.train_peak / GIB:>9.2f}  {'+'.join(RESIDENT)} + {' + '.join(TRAIN_ONLY)}")
    kept = "+".join(k for k in RESIDENT if k not in OFFLOADED)
    if not p.pool_ranks:
        lines.append(f"{'rollout peak':<16}{p.rollout_peak / GIB:>9.2f}  {kept} + rollout_engine "
                     f"({', '.join(OFFLOADED)} on the host)")
    lines.append(f"{'GPU':<16}{p.gpu_bytes / GIB:>9.2f}")
    for problem in p.problems:
        lines.append(f"layout error: {problem}")
    if p.fits:
        lines.append(f"verdict: FITS (peak {p.peak / GIB:.1f} of {p.gpu_bytes / GIB:.1f} GiB, "
                     f"{100 * p.peak / p.gpu_bytes:.0f}%)")
    elif p.problems:
        lines.append(f"verdict: DOES NOT FIT: {len(p.problems)} layout error(s)")
    else:
        lines.append(f"verdict: DOES NOT FIT (peak {p.peak / GIB:.1f} > {p.gpu_bytes / GIB:.1f} GiB); largest term: "
                     f"{p.largest_term()} ({p.terms[p.largest_term()] / GIB:.1f} GiB)")
    return "\n".join(lines)
