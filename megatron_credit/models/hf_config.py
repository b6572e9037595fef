"""Hugging Face config -> megatron ``TransformerConfig`` for the dense families we train.

Supported ``model_type``: ``qwen2`` (Qwen2 and Qwen2.5: QKV bias, no output-projection bias),
``qwen3`` (per-head RMSNorm on q and k, optional ``attention_bias``), ``llama`` (Llama 3 / 3.1 / 3.2,
including the ``llama3`` RoPE scaling when it uses megatron's fixed low/high frequency factors),
``mistral`` (Llama-shaped, explicit ``head_dim``, ``sliding_window`` off). All are pre-norm RMSNorm
decoders with SwiGLU MLPs, GQA and RoPE on the whole head; where they differ is each family's
:class:`~megatron_credit.families.base.Family` (``megatron_credit/families/<family>.py``).

transformers 4.x keeps RoPE settings in ``rope_theta`` / ``rope_scaling``; 5.x in one dict
``rope_parameters`` (``rope_theta``, ``rope_type``, scaling fields). ``rope_settings`` reads both.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_credit.families import family_of, supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()

# megatron's RotaryEmbedding._apply_scaling (models/common/embeddings/rotary_pos_embedding.py) takes
# only the factor from GPTModel; the other llama3 fields are fixed at these defaults.
_MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeSettings:
    """RoPE as megatron's ``GPTModel`` takes it."""

    base: float
    """``rotary_base`` (HF ``rope_theta``)."""
    llama3_scaling_factor: Optional[float] = None
    """Llama 3.1 frequency scaling factor, or None for plain RoPE."""


def _get(hf_config, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, default)
    return default if value is None else value


def rope_settings(hf_config) -> RopeSettings:
    """Read RoPE base and scaling from either transformers 4.x or 5.x attribute names.

    Refuses (``ValueError`` naming the field) any scaling megatron's RoPE cannot reproduce exactly.
    """
    params = dict(_get(hf_config, "rope_parameters", None) or {})
    scaling = dict(_get(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", _get(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("hf_config: no rope_theta in rope_parameters or rope_theta")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeSettings(base=float(theta))
    if rope_type == "llama3":
        for key, fixed in _MEGATRON_LLAMA3_FIXED.items():
            if key in merged and float(merged[key]) != fixed:
                raise ValueError(
                    f"hf_config.rope_parameters.{key}={merged[key]} is not supported: megatron-core's "
                    f"llama3 RoPE scaling fixes it at {fixed}")
        return RopeSettings(base=float(theta), llama3_scaling_factor=float(merged["factor"]))
    raise ValueError(f"hf_config.rope_parameters.rope_type={rope_type!r} is not supported "
                     "(supported: 'default', 'llama3')")


def head_dim(hf_config) -> int:
    """Per-head channels: HF ``head_dim`` when set (Qwen3 decouples it), else hidden / heads."""
    return int(_get(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads))


def _biases(hf_config) -> tuple[bool, bool]:
    """(add_qkv_bias, add_bias_linear) for the family; refuses biases megatron cannot place."""
    model_type = hf_config.model_type
    if family_of(model_type).qkv_bias:
        return True, False  # Qwen2 hard-codes bias on q/k/v and none on o_proj / MLP
    if bool(_get(hf_config, "attention_bias", False)) or bool(_get(hf_config, "mlp_bias", False)):
        # Llama's and Qwen3's attention_bias also biases o_proj (and Llama's mlp_bias the MLP):
        # megatron's single add_bias_linear flag would bias every linear, a different model.
        raise ValueError(f"hf_config.attention_bias / mlp_bias = True is not supported for {model_type}")
    return False, False


def _check_heads(hf_config, heads: int, kv_heads: int) -> None:
    """The model's own head shapes, named by its fields (megatron would name a tensor instead)."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"model.architecture: num_key_value_heads={kv_heads} must divide "
                         f"num_attention_heads={heads} (both >= 1)")
    if _get(hf_config, "head_dim", None) is None and hf_config.hidden_size % heads:
        raise ValueError(f"model.architecture: num_attention_heads={heads} does not divide "
                         f"hidden_size={hf_config.hidden_size} (or set head_dim)")


def check_parallel_fits_model(hf_config, parallel, *, world_size: Optional[int] = None) -> None:
    """Raise ``ValueError`` naming the field when ``parallel`` cannot shard this model.

    Runs before anything is built: heads must divide by TP, KV heads by TP or TP by KV heads
    (megatron-core then gives each rank's queries the KV head of their group), layers by PP, and
    (when ``world_size`` is given) TP x PP x CP must divide the world size.
    """
    refused = family_of(hf_config.model_type).refuse(hf_config)
    if refused:
        raise ValueError(refused)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = _get(hf_config, "num_key_value_heads", heads)
    _check_heads(hf_config, heads, kv_heads)
    if heads % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size={tp} does not divide "
                         f"num_attention_heads={heads}")
    if kv_heads % tp and tp % kv_heads:
        # megatron-core accepts TP > KV heads when TP is a multiple of them: linear_qkv is split in
        # contiguous row blocks, and each rank all-gathers the fused QKV output and keeps its group.
        raise ValueError(f"parallel.tensor_model_parallel_size={tp} must divide num_key_value_heads={kv_heads} "
                         "or be a multiple of it")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"parallel.pipeline_model_parallel_size={pp} does not divide "
                         f"num_hidden_layers={hf_config.num_hidden_layers}")
    _check_experts(hf_config, parallel)
    if world_size is not None:
        parallel.validate(world_size=world_size)


def _check_experts(hf_config, parallel) -> None:
    """EP must divide the routed experts (a dense model takes EP = 1 only); the experts' TP is the TP size
    (the weight loading and sync shard an expert's weights over the TP ranks)."""
    ep = getattr(parallel, "expert_model_parallel_size", 1)
    experts = family_of(hf_config.model_type).num_experts(hf_config)
    if ep > 1 and not experts:
        raise ValueError(f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model: "
                         f"{hf_config.model_type} has no routed experts")
    if experts and experts % ep:
        raise ValueError(f"parallel.expert_model_parallel_size={ep} does not divide num_experts={experts}")
    etp = getattr(parallel, "expert_tensor_parallel_size", None)
    if etp is not None and etp != parallel.tensor_model_parallel_size:
        raise ValueError(f"parallel.expert_tensor_parallel_size={etp} must equal tensor_model_parallel_size="
                         f"{parallel.tensor_model_parallel_size} (or be unset): the experts' weights are loaded "
                         "and synced over the TP ranks")


def check_sequence_length(hf_config, length: int, *, what: str = "sequence") -> None:
    """Refuse a ``length``-token sequence beyond the model's ``max_position_embeddings``.

    megatron's RoPE computes any position, so a longer sequence would run silently past what the
    model was trained for. Raise ``model.max_position_embeddings`` (and usually ``model.rope_theta``)
    explicitly in the recipe instead. ``what`` names the sequence in the error.

    >>> from types import SimpleNamespace as NS
    >>> check_sequence_length(NS(max_position_embeddings=4096), 4096)
    >>> check_sequence_length(NS(max_position_embeddings=4096), 20480, what="prompt + max_new_tokens")
    Traceback (most recent call last):
    ...
    ValueError: prompt + max_new_tokens of 20480 tokens is longer than the model's max_position_embeddings=4096: set model.max_position_embeddings (and model.rope_theta) explicitly in the recipe, or shorten it
    """
    max_pos = int(hf_config.max_position_embeddings)
    if length > max_pos:
        raise ValueError(f"{what} of {length} tokens is longer than the model's max_position_embeddings={max_pos}: "
                         "set model.max_position_embeddings (and model.rope_theta) explicitly in the recipe, "
                         "or shorten it")


def transformer_config_from_hf(hf_config, *, parallel, params_dtype: torch.dtype = torch.float32,
                               transformer_engine: bool = False, **overrides):
    """A megatron ``TransformerConfig`` equal in architecture to ``hf_config``.

    ``parallel`` is a ``megatron_credit.recipe.config.ParallelConfig``. ``overrides`` are passed to
    ``TransformerConfig`` last (e.g. ``recompute_granularity="full"``). Weights are initialised on
    the CPU (``use_cpu_initialization``) so that TP shards are slices of the TP=1 weights for the
    same seed. ``transformer_engine``: the model is built with the TE spec, so the fused kernels TE and
    apex provide are on (``models/fused_kernels.py``) and a mixture of experts' routed experts run as TE's
    grouped GEMM (``moe_grouped_gemm``: megatron's ``TEGroupedMLP``, one GEMM per linear for all of a
    layer's local experts); the local spec keeps the kernels off and builds ``SequentialMLP`` (one linear per
    expert). ``moe_grouped_gemm=False`` in ``overrides`` keeps ``SequentialMLP`` under TE too (``recipe.moe``).
    """
    from megatron_credit.models.fused_kernels import fused_kernels

    from megatron.core.transformer import TransformerConfig

    check_parallel_fits_model(hf_config, parallel)
    rope_settings(hf_config)  # refuse unsupported RoPE before building anything
    if bool(_get(hf_config, "use_sliding_window", False)):
        # Qwen2 / Qwen3 configs can turn on sliding-window attention on some layers; megatron's
        # local spec has no sliding window, so building it would silently use full attention.
        raise ValueError(f"hf_config.use_sliding_window=True is not supported (sliding_window="
                         f"{_get(hf_config, 'sliding_window', None)}): the megatron actor uses full "
                         "causal attention on every layer")
    add_qkv_bias, add_bias_linear = _biases(hf_config)
    heads = hf_config.num_attention_heads
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=_get(hf_config, "num_key_value_heads", heads),
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=float(_get(hf_config, "attention_dropout", 0.0)),
        init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=getattr(parallel, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(parallel, "expert_tensor_parallel_size", None),
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # CPU init: identical full weights on every rank for one seed, then sliced (TP invariance).
        use_cpu_initialization=True,
        # the local spec's softmax and norms (the TE spec has its own fused ones)
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        # fp32 softmax in attention, as HF does.
        attention_softmax_in_fp32=True,
    )
    kwargs.update(family_of(hf_config.model_type).transformer_config_kwargs(hf_config))
    if kwargs.get("num_moe_experts"):  # the one place the experts' implementation follows the spec
        kwargs["moe_grouped_gemm"] = transformer_engine
    swiglu = kwargs["gated_linear_unit"] and kwargs["activation_func"] is torch.nn.functional.silu
    kwargs.update(fused_kernels(transformer_engine=transformer_engine, swiglu=swiglu,
                                context_parallel_size=parallel.context_parallel_size).overrides())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def actor_transformer_config(hf_config, *, parallel, params_dtype: torch.dtype, recompute: Optional[str] = None,
                             from_checkpoint: bool = False, transformer_engine: bool = False, moe=None):
    """The trainer's ``TransformerConfig`` (``transformer_engine``: built with the TE spec, its fused kernels
    on): :func:`transformer_config_from_hf` with the per-token loss
    (``calculate_per_token_loss``: megatron divides by nothing, ``trainer/actor.py``'s loss contract), no
    random init when the weights come from a checkpoint (minutes per rank at 32B; ``build_gpt_model`` sets
    the TP attributes init would have set), the recompute (``full``: every layer, ``selective``) and, for a
    mixture-of-experts model, the router losses of ``moe`` (the recipe's ``MoeConfig``)."""
    overrides: dict[str, Any] = dict(calculate_per_token_loss=True)
    if moe is not None and family_of(hf_config.model_type).num_experts(hf_config):
        overrides.update(moe.transformer_config_kwargs())  # the recipe's router losses (``recipe/moe.py``)
    if from_checkpoint:
        overrides["perform_initialization"] = False
    if recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        overrides.update(recompute_granularity="selective")
    return transformer_config_from_hf(hf_config, parallel=parallel, params_dtype=params_dtype,
                                      transformer_engine=transformer_engine, **overrides)
