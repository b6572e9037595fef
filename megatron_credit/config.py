"""The typed recipe: keyword-only dataclasses, one YAML file plus dotted ``key.sub=value`` overrides.

A recipe is read once at the entry point (``load_recipe``) and passed down as frozen objects; nothing
mutates it at run time. Each section validates its own fields in ``__post_init__``; checks that need
the world size or the model's shape live in ``ParallelConfig.validate`` and
``megatron_credit.models.check_parallel_fits_model`` and run before any model is built.

Sections: ``model``, ``parallel``, ``data``, ``rollout``, ``reward``, ``algorithm`` (name + typed
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
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the actor is sharded; the data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """Tensor (Megatron column/row) parallel ranks; must divide attention heads and KV heads."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; must divide the number of layers."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (load-balanced 2*cp chunks)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP regions (GPU only: the local-spec norm refuses it)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")

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

    def data_parallel_size(self, *, world_size: int) -> int:
        """Data-parallel replicas for ``world_size`` ranks (after ``validate``)."""
        self.validate(world_size=world_size)
        return world_size // self.model_parallel_size


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
    max_position_embeddings: Optional[int] = None
    """Overrides the checkpoint's context length (e.g. Qwen2.5-Math-7B has 4096 positions, too few for
    20K-token responses); the trainer refuses longer sequences. None keeps the checkpoint's."""
    rope_theta: Optional[float] = None
    """Overrides the checkpoint's RoPE base (often raised together with ``max_position_embeddings``).
    None keeps the checkpoint's. The rollout engine must get the same two overrides."""
    transformer_impl: str = "auto"
    """Layer implementation: "auto" (Transformer Engine on GPU, where its absence is an error; megatron's
    local spec on CPU), "transformer_engine", or "local" (allowed on GPU only when asked for: its attention
    keeps full fp32 score matrices, ~10 GB per layer at 20K tokens)."""

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.architecture is None):
            raise ValueError("model: give exactly one of model.name_or_path and model.architecture")
        if self.architecture is not None and "model_type" not in self.architecture:
            raise ValueError("model.architecture must contain 'model_type' (qwen2, qwen3 or llama)")
        if self.architecture is not None:  # a typo would otherwise build the default-sized model silently
            from megatron_credit.models.arch_keys import check_architecture_keys

            check_architecture_keys(self.architecture)
        if self.params_dtype not in _DTYPES + ("auto",):
            raise ValueError(f"model.params_dtype must be 'auto' or one of {_DTYPES}, got {self.params_dtype!r}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"model.max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta must be > 0, got {self.rope_theta}")
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
class DataConfig:
    """Where prompts come from: the synthetic arithmetic task or a DAPO-schema jsonl / parquet file."""

    source: str = "synthetic_arith"
    """``synthetic_arith`` (generated by index, no files) or ``dataset`` (``train_path``)."""
    train_path: Optional[str] = None
    """DAPO-schema jsonl / parquet file of training prompts (``source: dataset``)."""
    val_path: Optional[str] = None
    """Held-out prompts (``source: dataset``); None: validation is skipped."""
    tokenizer_path: Optional[str] = None
    """A Hugging Face tokenizer directory (``source: dataset``); None: the model directory."""
    num_operands: int = 2
    """synthetic_arith: operands per problem."""
    min_operand: int = 0
    """synthetic_arith: smallest operand."""
    max_operand: int = 9
    """synthetic_arith: largest operand."""
    tokenizer_vocab_size: int = 64
    """synthetic_arith: size of the sentencepiece tokenizer trained on the task."""
    max_prompt_len: int = 64
    """Prompts longer than this many tokens are dropped (datasets) or refused (synthetic)."""

    def __post_init__(self) -> None:
        if self.source not in ("synthetic_arith", "dataset"):
            raise ValueError(f"data.source must be 'synthetic_arith' or 'dataset', got {self.source!r}")
        if self.source == "dataset" and not self.train_path:
            raise ValueError("data.train_path is required with data.source: dataset")
        _positive(self, "data", "num_operands", "tokenizer_vocab_size", "max_prompt_len")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How responses are sampled each iteration."""

    engine: str = "hf"
    """Name in ``megatron_credit.rollout.ROLLOUT_ENGINES`` (``hf`` on CPU, ``vllm`` on GPU)."""
    prompts_per_step: int = 64
    """Prompts per iteration over the whole job (split over data-parallel ranks)."""
    n: int = 8
    """Samples per prompt (the group of GRPO-style estimators)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_response_len: int = 8
    """The one maximum response length: sampling budget, overlong shaping, Dr.GRPO's L."""
    max_batch_size: Optional[int] = None
    """Rows decoded together by the engine (None: all)."""
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the engine's constructor (vllm: tensor_parallel_size,
    gpu_memory_utilization, weight_transfer, engine_kwargs, ...)."""

    def __post_init__(self) -> None:
        _positive(self, "rollout", "prompts_per_step", "n", "max_response_len")
        from megatron_credit.rollout.engine import ROLLOUT_ENGINES
        import megatron_credit.rollout  # noqa: F401  (registers the built-in engines)

        ROLLOUT_ENGINES.get(self.engine)  # ValueError listing the valid names
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0 for RL (greedy has no policy gradient), "
                             f"got {self.temperature}")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Scoring and shaping of responses."""

    num_workers: int = 0
    """Reward pool processes (killable, per-item timeout); 0 scores in-process (trusted verifiers)."""
    timeout_s: float = 10.0
    """Per-item verifier deadline in the pool."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong window before ``rollout.max_response_len`` (0: off)."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the maximum length."""

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.overlong_buffer_len < 0:
            raise ValueError("reward.num_workers and reward.overlong_buffer_len must be >= 0")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Which algorithm, with its typed parameters (``megatron_credit.algorithms``)."""

    name: str = "grpo"
    """Name in ``ALGORITHMS``: grpo, dapo, dr_grpo, rloo, gspo, ppo, fipo."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the algorithm's parameter dataclass (clip ranges, tau, ...); unknown keys fail."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to a frozen reference model (0: no reference model)."""
    kl_estimator: str = "k3"
    """k1, k3 or low_var_kl."""
    dynamic_sampling: bool = False
    """DAPO: keep only groups whose accuracy varies, drawing more prompts until the batch is full."""
    max_draws: int = 8
    """Dynamic sampling: at most this many draws of ``prompts_per_step`` per iteration."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling of rollout vs trainer log-probs, capped at this (None: off)."""

    def __post_init__(self) -> None:
        from megatron_credit.algorithms import ALGORITHMS, KL_ESTIMATORS

        ALGORITHMS.get(self.name)  # ValueError listing the valid names
        ALGORITHMS.get(self.name).make_params(self.params, where="algorithm.params")
        KL_ESTIMATORS.get(self.kl_estimator)
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        _positive(self, "algorithm", "max_draws")

    def spec_and_params(self):
        """``(AlgorithmSpec, its parameter dataclass)``."""
        from megatron_credit.algorithms import ALGORITHMS

        spec = ALGORITHMS.get(self.name)
        return spec, spec.make_params(self.params, where="algorithm.params")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    schedule: str = "constant"
    """constant or cosine."""
    decay_steps: int = 0
    """Length of the cosine decay in optimizer steps (its own length: not ``train.steps``)."""
    critic_lr: float = 1e-3
    """Learning rate of the value head (PPO)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule must be constant or cosine, got {self.schedule!r}")
        if self.schedule == "cosine" and self.decay_steps < 1:
            raise ValueError("optim.decay_steps must be >= 1 with optim.schedule: cosine")
        if self.warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError("optim.warmup_steps and optim.clip_grad must be >= 0")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based).

        >>> OptimConfig(lr=1.0, warmup_steps=2).lr_at(0), OptimConfig(lr=1.0, warmup_steps=2).lr_at(5)
        (0.5, 1.0)
        """
        import math

        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        t = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The iteration loop."""

    steps: int = 10
    """RL iterations to run (where the run stops; schedules have their own lengths)."""
    num_minibatches: int = 2
    """Optimizer steps per epoch over an iteration's batch."""
    epochs: int = 1
    """Passes over the batch per iteration."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch (per rank, before the CP split)."""
    val_every: int = 0
    """Validate every this many iterations (0: never)."""
    val_prompts: int = 128
    """Held-out prompts per validation."""
    val_samples: int = 1
    """k of Avg@k."""
    recompute: Optional[str] = None
    """Activation recomputation: None, ``selective`` or ``full``."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the vocabulary-parallel log-prob pass."""

    def __post_init__(self) -> None:
        _positive(self, "train", "steps", "num_minibatches", "epochs", "max_tokens_per_microbatch",
                  "val_prompts", "val_samples", "logprob_chunk_size")
        if self.val_every < 0:
            raise ValueError(f"train.val_every must be >= 0, got {self.val_every}")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"train.recompute must be null, selective or full, got {self.recompute!r}")


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """A supervised warm-up of the actor on the synthetic task before RL (the demo starts from it)."""

    steps: int = 0
    """Supervised steps (0: none; real runs start from a pretrained checkpoint instead)."""
    batch_size: int = 64
    """Problems per step."""
    lr: float = 1e-3
    """AdamW learning rate of the warm-up."""
    carry_drop_prob: float = 0.0
    """Probability that a label drops its carries (teaches a systematic misconception RL can fix)."""
    cache_dir: Optional[str] = None
    """Where warmed-up weights are cached (None: ``~/.cache/megatron_credit/warmup``)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or not 0.0 <= self.carry_drop_prob <= 1.0:
            raise ValueError("warmup.steps must be >= 0 and warmup.carry_drop_prob in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every: int = 0
    """Save every this many iterations (0: only at the end and on SIGTERM)."""
    keep: int = 2
    """Newest complete checkpoints kept."""
    save_at_end: bool = True
    """Save after the last iteration."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard event files to the output directory."""
    wandb: Optional[str] = None
    """A wandb project name (None: off)."""
    progress: bool = True
    """A tqdm progress bar on rank 0."""
    plots: bool = True
    """PNG plots in ``plots/`` at the end of the run."""


def _positive(section, where: str, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 1:
            raise ValueError(f"{where}.{name} must be >= 1, got {getattr(section, name)}")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A whole run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(architecture=TINY_QWEN2))
    """The actor."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sharding of the actor."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring and shaping."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm."""
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
    seed: int = 1234
    """Seed of every generator (model init, dropout, data, sampling)."""


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


def _build(cls, data: Mapping[str, Any], where: str):
    """Build dataclass ``cls`` from ``data``, recursing into dataclass-typed fields; unknown keys fail."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'recipe'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in {where or 'recipe'}; valid: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            kwargs[key] = _build(hint, value, path)
        else:
            kwargs[key] = _check_scalar(hint, value, path)
    return cls(**kwargs)


def _check_scalar(hint, value: Any, path: str) -> Any:
    """``value`` checked against a scalar type hint (``int``, ``float``, ``bool``, ``str``, or one of
    them ``Optional``); other hints pass ``value`` through. Returns the value to store.

    PyYAML 1.1 reads ``1e-6`` (no dot) as a string, so ``float`` also takes numeric strings; ``int``
    refuses bools (YAML ``yes``) and strings; ``bool`` takes only bools; ``float`` refuses ``inf`` and
    ``nan`` (YAML ``.inf``, or the strings): no field of a recipe means anything at infinity.

    >>> _check_scalar(float, "1e-6", "optim.lr"), _check_scalar(float, 3, "optim.lr")
    (1e-06, 3.0)
    >>> _check_scalar(int, True, "train.steps")
    Traceback (most recent call last):
    ...
    ValueError: train.steps must be an int, got True (bool)
    >>> _check_scalar(float, "inf", "optim.lr")
    Traceback (most recent call last):
    ...
    ValueError: optim.lr must be a finite number, got 'inf' (str)
    """
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) != 1:
            return value
        hint = args[0]

    def refuse(kind: str):
        return ValueError(f"{path} must be {kind}, got {value!r} ({type(value).__name__})")

    if hint is bool:
        if not isinstance(value, bool):
            raise refuse("a bool (true / false)")
    elif hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse("an int")
    elif hint is float:
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise refuse("a number") from None
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise refuse("a number")
        else:
            number = float(value)
        if number != number or number in (float("inf"), float("-inf")):  # nan, +-inf
            raise refuse("a finite number")
        return number
    elif hint is str:
        if not isinstance(value, str):
            raise refuse("a string")
    return value


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

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"recipe {path}: the file must hold a mapping of sections (model:, parallel:, ...), "
                         f"got a {type(data).__name__}")
    return recipe_from_dict(data, overrides=overrides)
