"""The typed recipe: keyword-only dataclasses, one YAML file plus dotted ``key.sub=value`` overrides.

A recipe is read once at the entry point (``load_recipe``) and passed down as frozen objects; nothing
mutates it at run time. Each section validates its own fields in ``__post_init__``; checks that need
the world size or the model's shape live in ``ParallelConfig.validate`` and
``megatron_credit.models.check_parallel_fits_model`` and run before any model is built.

Sections: ``model``, ``parallel``, ``moe``, ``distributed``, ``cluster`` (planning only), ``data``, ``rollout``, ``reward``, ``algorithm`` (name + typed
params), ``optim``, ``train``, ``warmup``, ``checkpoint``, ``logging``, plus ``seed``.

>>> r = recipe_from_dict({"parallel": {"tensor_model_parallel_size": 2}},
...                      overrides=["parallel.context_parallel_size=2", "seed=7"])
>>> r.parallel.tensor_model_parallel_size, r.parallel.context_parallel_size, r.seed
(2, 2, 7)
>>> r.parallel.data_parallel_size(world_size=8)
2
>>> r.parallel.validate(world_size=6)
Traceback (most recent call last):
...
ValueError: parallel: world_size 6 is not divisible by tensor_model_parallel_size (2) x pipeline_model_parallel_size (1) x context_parallel_size (2) = 4
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping, Optional, Sequence

from megatron_credit.gpu_kinds import GPUS
from megatron_credit.recipe.env_section import EnvConfig
from megatron_credit.recipe.moe import MoeConfig
from megatron_credit.recipe.sections import (AlgorithmConfig, CheckpointConfig, DataConfig, LoggingConfig,
                                             OptimConfig, RewardConfig, RolloutConfig, TrainConfig,
                                             WarmupConfig)
from megatron_credit.typed_build import NonNegativeInt, PositiveFloat, PositiveInt, Range
from megatron_credit.typed_build import build_dataclass as _build

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the actor is sharded; the data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: PositiveInt = 1
    """Tensor (Megatron column/row) parallel ranks; must divide attention heads and KV heads."""
    pipeline_model_parallel_size: PositiveInt = 1
    """Pipeline stages; must divide the number of layers."""
    context_parallel_size: PositiveInt = 1
    """Ranks that split each sequence (load-balanced 2*cp chunks)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP regions (GPU only: the local-spec norm refuses it)."""
    expert_model_parallel_size: PositiveInt = 1
    """Ranks that split a mixture-of-experts layer's routed experts (EP); must divide the experts. megatron
    carves the EP groups out of the TP x CP x DP ranks of a pipeline stage, so EP x ETP must divide them."""
    expert_tensor_parallel_size: Optional[PositiveInt] = None
    """Tensor-parallel ranks of one expert (ETP); None: the TP size (megatron's default, the only value
    the trainer's expert weight loading supports)."""

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (``expert_tensor_parallel_size``, default the TP size)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: TP x PP x CP."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def validate(self, *, world_size: int) -> None:
        """Raise ``ValueError`` unless TP x PP x CP divides ``world_size``."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"parallel: world_size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size "
                f"({self.context_parallel_size}) = {self.model_parallel_size}")
        stage = world_size // self.pipeline_model_parallel_size  # the TP x CP x DP ranks of one stage
        experts = self.expert_model_parallel_size * self.expert_tp
        if stage % experts:
            raise ValueError(
                f"parallel.expert_model_parallel_size={self.expert_model_parallel_size} x expert_tensor_parallel_size="
                f"{self.expert_tp} must divide the {stage} ranks of a pipeline stage (world_size {world_size} / "
                f"pipeline_model_parallel_size {self.pipeline_model_parallel_size}): megatron's expert groups "
                "split them")

    def data_parallel_size(self, *, world_size: int) -> int:
        """Data-parallel replicas for ``world_size`` ranks (after ``validate``)."""
        self.validate(world_size=world_size)
        return world_size // self.model_parallel_size


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """The process groups of the run."""

    timeout_s: PositiveFloat = 3 * 3600.0
    """Timeout of every process group the trainer makes (the default one, megatron's, the engines'):
    ranks wait in them while the engines generate, which at 20K-token responses takes far longer than
    NCCL's default of 10 minutes."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The cluster a recipe was sized for and the memory choices the planner assumes (``tools/plan.py``,
    ``pretrain_rl.py --dry-run``, the launchers' defaults). The trainer reads none of it (the recipe checks
    ``distributed_optimizer`` against ``optim``)."""

    nodes: PositiveInt = 1
    """Nodes the recipe was sized for."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node."""
    gpu: str = "h100-80gb"
    """GPU kind, a key of ``megatron_credit.gpu_kinds.GPUS``."""
    distributed_optimizer: bool = False
    """Plan optimizer states sharded over DP x CP (megatron's distributed optimizer). The run shards them
    with ``optim.backend: megatron`` + ``optim.distributed_optimizer: true`` (which the planner also
    follows); true here without them is refused (the plan would assume what the run does not do)."""

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"cluster.gpu={self.gpu!r} is not one of {sorted(GPUS)}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor's linears (``models/lora.py``): the base model frozen, only the adapters
    (and a critic's head) trained. ``model.lora.rank=8`` alone turns it on."""

    rank: Annotated[int, Range(ge=0, note="0 = off")] = 0
    """The adapters' rank r; 0 = off (every parameter trains)."""
    alpha: Optional[PositiveFloat] = None
    """The update's scale is alpha / rank; None = 2 x rank."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout on an adapter's input (PEFT's ``lora_dropout``)."""
    targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    """megatron's modules that get adapters: attention's QKV and output projections, the MLP's in and out
    (a dense MLP's and a shared expert's; routed experts stay frozen)."""

    def __post_init__(self) -> None:
        from megatron_credit.models.lora import TARGETS

        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"model.lora.targets: unknown {unknown}; megatron's projections are {list(TARGETS)}")
        if not self.targets:
            raise ValueError("model.lora.targets is empty: name at least one of " + ", ".join(TARGETS))
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"model.lora.targets names one module twice: {list(self.targets)}")
        if self.rank == 0 and (self.alpha is not None or self.dropout):
            raise ValueError("model.lora.rank is 0 (LoRA off), but model.lora."
                             f"{'alpha' if self.alpha is not None else 'dropout'} is set: give model.lora.rank >= 1")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha (2 x rank when not given)."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which actor to build: a Hugging Face config (from a directory or inline), its dtype, explicit
    context-length / RoPE overrides, and the layer implementation."""

    name_or_path: Optional[str] = None
    """A local Hugging Face model directory (its ``config.json`` is read; no weights are loaded here)."""
    architecture: Optional[Mapping[str, Any]] = None
    """Inline Hugging Face config fields (``model_type`` required), e.g. a tiny model for tests."""
    params_dtype: str = "auto"
    """Parameter dtype: float32, bfloat16, float16, or "auto": the checkpoint's ``torch_dtype`` on GPU
    (bfloat16 for every Qwen2.5 / Qwen3 / Llama 3 release; float32 when it records none) and float32
    on CPU. Recipes for real runs state it."""
    max_position_embeddings: Optional[PositiveInt] = None
    """Overrides the checkpoint's context length (e.g. Qwen2.5-Math-7B has 4096 positions, too few for
    20K-token responses); the trainer refuses longer sequences. None keeps the checkpoint's."""
    rope_theta: Optional[PositiveFloat] = None
    """Overrides the checkpoint's RoPE base (often raised together with ``max_position_embeddings``).
    None keeps the checkpoint's. The rollout engine must get the same two overrides."""
    transformer_impl: str = "auto"
    """Layer implementation: "auto" (Transformer Engine on GPU, where its absence is an error; megatron's
    local spec on CPU), "transformer_engine", or "local" (allowed on GPU only when asked for: its attention
    keeps full fp32 score matrices, ~10 GB per layer at 20K tokens)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``rank: 0``, the default: off)."""

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.architecture is None):
            raise ValueError("model: give exactly one of model.name_or_path and model.architecture")
        if self.architecture is not None and "model_type" not in self.architecture:
            from megatron_credit.families import supported_model_types

            raise ValueError(f"model.architecture must contain 'model_type' ({', '.join(supported_model_types())})")
        if self.architecture is not None:  # a typo would otherwise build the default-sized model silently
            from megatron_credit.models.arch_keys import check_architecture_keys

            check_architecture_keys(self.architecture)
        if self.params_dtype not in _DTYPES + ("auto",):
            raise ValueError(f"model.params_dtype must be 'auto' or one of {_DTYPES}, got {self.params_dtype!r}")
        if self.transformer_impl not in ("auto", "transformer_engine", "local"):
            raise ValueError("model.transformer_impl must be one of ('auto', 'transformer_engine', 'local'), "
                             f"got {self.transformer_impl!r}")

    def hf_config(self):
        """The ``transformers.PretrainedConfig`` this section names, with the explicit overrides applied.

        >>> cfg = ModelConfig(architecture=TINY_QWEN2, max_position_embeddings=512, rope_theta=1e6).hf_config()
        >>> cfg.max_position_embeddings
        512
        >>> from megatron_credit.models import rope_settings
        >>> rope_settings(cfg).base
        1000000.0
        """
        import transformers

        if self.name_or_path is not None:
            cfg = transformers.AutoConfig.from_pretrained(self.name_or_path)
        else:
            arch = dict(self.architecture)
            cfg = transformers.AutoConfig.for_model(arch.pop("model_type"), **arch)
        if self.max_position_embeddings is not None:
            cfg.max_position_embeddings = int(self.max_position_embeddings)
        if self.rope_theta is not None:
            # transformers 5.x keeps the base in rope_parameters, 4.x in rope_theta.
            params = getattr(cfg, "rope_parameters", None)
            if isinstance(params, dict):
                cfg.rope_parameters = {**params, "rope_theta": float(self.rope_theta)}
            else:
                cfg.rope_theta = float(self.rope_theta)
        return cfg

    def torch_dtype(self, *, cuda: Optional[bool] = None):
        """The parameter dtype; "auto" resolves to the checkpoint's on GPU and float32 on CPU.

        ``cuda``: whether the actor runs on GPU (default: ``torch.cuda.is_available()``).

        >>> ModelConfig(architecture={**TINY_QWEN2, "torch_dtype": "bfloat16"}).torch_dtype(cuda=True)
        torch.bfloat16
        >>> ModelConfig(architecture={**TINY_QWEN2, "torch_dtype": "bfloat16"}).torch_dtype(cuda=False)
        torch.float32
        """
        import torch

        if self.params_dtype != "auto":
            return getattr(torch, self.params_dtype)
        if cuda is None:
            cuda = torch.cuda.is_available()
        if not cuda:
            return torch.float32
        cfg = self.hf_config()
        stored = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)  # transformers 5.x / 4.x
        name = str(stored).removeprefix("torch.") if stored is not None else "float32"
        if name not in _DTYPES:
            raise ValueError(f"model.params_dtype='auto': the checkpoint's dtype {name!r} is not one of "
                             f"{_DTYPES}; set model.params_dtype explicitly")
        return getattr(torch, name)

    def use_transformer_engine(self) -> Optional[bool]:
        """``build_gpt_model``'s ``use_transformer_engine``: None for "auto", else whether TE is asked for."""
        return None if self.transformer_impl == "auto" else self.transformer_impl == "transformer_engine"


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A whole run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(architecture=TINY_QWEN2))
    """The actor."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sharding of the actor."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Process groups (timeouts)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The cluster the recipe was sized for (planning and launchers only)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """A mixture-of-experts actor's router losses (ignored by a dense model)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring and shaping."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts in an environment (none: one response per prompt)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up (synthetic task only)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logs and pictures."""
    seed: NonNegativeInt = 1234
    """Seed of every generator (model init, dropout, data, sampling)."""

    def __post_init__(self) -> None:
        if self.cluster.distributed_optimizer and not self.optim.distributed_optimizer:
            raise ValueError("cluster.distributed_optimizer: true plans sharded optimizer states that this run would "
                             "not shard: set optim.backend: megatron and optim.distributed_optimizer: true (or "
                             "cluster.distributed_optimizer: false)")
        if self.model.lora.enabled:
            kind = self.algorithm.build().critic_kind
            if kind is not None and kind.separate_model:
                raise ValueError("model.lora.rank > 0 with algorithm.params.critic: separate: the separate value "
                                 "model would be a second full model to train; use the trunk critic "
                                 "(algorithm.params.critic: trunk) with LoRA, or model.lora.rank: 0")

    def problems(self, arch, *, world_size: int) -> list[str]:
        """Every cross-section problem of this recipe on ``world_size`` ranks with the model ``arch`` (a
        Hugging Face config), each one line naming the field to change; ``[]`` when the recipe can run.

        The one set of layout checks: :meth:`validate` (the trainer, ``pretrain_rl.py``) refuses the first,
        the memory planner (``planning.plan``, ``--dry-run``) lists them all."""
        from megatron_credit.models.hf_config import check_parallel_fits_model, check_sequence_length
        from megatron_credit.data.sources import PROMPT_SOURCES
        from megatron_credit.recipe.sections import SYNTHETIC_SOURCES, launcher_problem

        out: list[str] = []
        try:
            check_parallel_fits_model(arch, self.parallel, world_size=world_size)
        except ValueError as exc:
            out.append(str(exc))
        p, r, t, w = self.parallel, self.rollout, self.train, self.warmup
        tp = p.tensor_model_parallel_size
        if arch.vocab_size % tp:  # the models are built without vocabulary padding (models/gpt.py)
            out.append(f"parallel.tensor_model_parallel_size={tp} does not divide vocab_size={arch.vocab_size}")
        dp = max(world_size // p.model_parallel_size, 1)
        if r.prompts_per_step % dp:
            out.append(f"rollout.prompts_per_step={r.prompts_per_step} must be divisible by the "
                       f"data-parallel size {dp}")
        if r.n < 2 and self.algorithm.build().critic_kind is None:  # silent zero gradients otherwise
            out.append(f"rollout.n={r.n}: algorithm {self.algorithm.name}'s advantages are relative to the group "
                       "of a prompt's samples, and a group of one has zero advantage (nothing trains); set "
                       "rollout.n >= 2, or use an algorithm with a critic (ppo)")
        why = launcher_problem(r.engine_options, tp=tp, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size)
        if why:  # the in-process vLLM engine's rule, read off engine_options alone
            out.append(why)
        out.extend(r.mode_facts().recipe_problems(r, world_size=world_size))  # the mode's own rules
        per_rank = r.prompts_per_step // dp * r.n
        if not r.prompts_per_step % dp and per_rank % t.num_minibatches:
            out.append(f"train.num_minibatches={t.num_minibatches} must divide the "
                       f"{per_rank} samples per data-parallel rank (prompts_per_step / DP x n)")
        if self.data.source not in SYNTHETIC_SOURCES:  # synthetic prompts are short; a file's or a library's need not be
            try:
                check_sequence_length(arch, self.data.max_prompt_len + r.max_response_len,
                                      what="data.max_prompt_len + rollout.max_response_len")
            except ValueError as exc:
                out.append(str(exc))
        e = self.env
        if e.enabled and e.max_total_tokens < r.max_response_len:
            out.append(f"env.max_total_tokens={e.max_total_tokens} must be at least rollout.max_response_len="
                       f"{r.max_response_len} (one turn's tokens)")
        if e.enabled:
            try:
                check_sequence_length(arch, e.max_total_tokens, what="env.max_total_tokens (a trajectory's response)")
            except ValueError as exc:
                out.append(str(exc))
        if self.data.source == "synthetic_tool" and not e.enabled:
            out.append("data.source=synthetic_tool leaves the answer's form to the model, which is meant to call a "
                       "tool: set env.name (calculator)")
        if w.steps and not PROMPT_SOURCES.get(self.data.source).warmup_traces:
            able = [n for n in PROMPT_SOURCES.names() if PROMPT_SOURCES.get(n).warmup_traces]
            out.append(f"warmup.steps > 0 needs a data.source whose task writes warm-up traces ({able}), got "
                       f"{self.data.source!r} (real runs start from a pretrained checkpoint)")
        if w.steps and w.retry_prob and not e.enabled:
            out.append(f"warmup.retry_prob={w.retry_prob} needs an environment (env.name) that answers the wrong "
                       "first attempts of the warm-up's traces")
        if w.steps and w.batch_size % dp:
            out.append(f"warmup.batch_size={w.batch_size} must be divisible by DP={dp}")
        return out

    @property
    def response_budget(self) -> int:
        """The most response tokens of one sample: ``rollout.max_response_len``, or a multi-turn trajectory's
        ``env.max_total_tokens`` (its turns and observations): what the planner sizes a sequence by."""
        return self.env.max_total_tokens if self.env.enabled else self.rollout.max_response_len

    @property
    def packing(self) -> bool:
        """Whether the trainer packs its micro-batches (``train.packing``; None: yes)."""
        return True if self.train.packing is None else self.train.packing

    def validate(self, *, world_size: int, arch) -> dict[str, int]:
        """Raise ``ValueError`` (the first of :meth:`problems`) unless the recipe runs on ``world_size``
        ranks with the model ``arch``; returns the layout ``{"tp", "pp", "cp", "dp"}`` (and ``"ep"`` when
        the experts are split)."""
        problems = self.problems(arch, world_size=world_size)
        if problems:
            raise ValueError(problems[0])
        p = self.parallel
        layout = {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
                  "cp": p.context_parallel_size, "dp": p.data_parallel_size(world_size=world_size)}
        if p.expert_model_parallel_size > 1:  # dense layouts (and their checkpoints' meta) stay as they were
            layout["ep"] = p.expert_model_parallel_size
        return layout


TINY_QWEN2: Mapping[str, Any] = types.MappingProxyType(dict(
    model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
))
"""A Qwen2-shaped model small enough for CPU tests (GQA 4:2, QKV bias, SwiGLU, RMSNorm)."""


# ---------------------------------------------------------------------------------------------------
# dict / YAML -> dataclasses


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML scalars.

    >>> parse_overrides(["parallel.tensor_model_parallel_size=2", "model.params_dtype=bfloat16"])
    {'parallel': {'tensor_model_parallel_size': 2}, 'model': {'params_dtype': 'bfloat16'}}
    """
    import yaml

    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key.sub=value")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r} conflicts with an earlier override of {p!r}")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def recipe_from_dict(data: Mapping[str, Any], *, overrides: Sequence[str] = ()) -> Recipe:
    """A ``Recipe`` from a plain mapping (a parsed YAML file) plus dotted overrides."""
    return _build(Recipe, _merge(data or {}, parse_overrides(overrides)), "")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain YAML-able data (what ``config.yaml`` of a run holds).

    >>> recipe_from_dict(recipe_to_dict(Recipe())) == Recipe()
    True
    """
    def plain(x):
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(recipe)


def load_recipe(path: str, *, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe file and apply dotted ``key.sub=value`` overrides."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except UnicodeDecodeError as exc:
        raise ValueError(f"recipe {path}: not a UTF-8 YAML text file ({exc.reason} at byte {exc.start})") from None
    if data is None:  # an empty file would run the built-in defaults (another algorithm, another model)
        raise ValueError(f"recipe {path}: the file is empty (no model:, algorithm:, ... sections)")
    if not isinstance(data, Mapping):
        raise ValueError(f"recipe {path}: the file must hold a mapping of sections (model:, parallel:, ...), "
                         f"got a {type(data).__name__}")
    return recipe_from_dict(data, overrides=overrides)
