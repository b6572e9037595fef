"""The megatron ``GPTModel`` for a Hugging Face config: layer spec choice and model construction.

Spec (:func:`use_transformer_engine_spec`): Transformer Engine's on GPU (untested here: TE cannot be
installed on the CPU development machines), megatron's local spec on CPU. On a GPU without Transformer
Engine the build is refused unless the local spec is asked for explicitly (``model.transformer_impl:
local``): its attention keeps full fp32 score matrices (~10 GB per layer at 20K tokens). Context
parallelism needs TE's ring attention; with the local spec, core attention is swapped for
``CpuContextParallelAttention`` (megatron's ``DotProductAttention`` asserts ``context_parallel_size == 1``).
A mixture of experts' routed experts follow the spec: TE's grouped GEMM (``TEGroupedMLP``) with TE's,
``SequentialMLP`` with the local one (``TransformerConfig.moe_grouped_gemm``, set by
``models/hf_config.transformer_config_from_hf``; their weight names differ, ``conversion/live.py`` reads both).

With ``capture_final_attention=True`` the decoder spec is per layer (:func:`gpt_decoder_block_spec`):
the global last layer's core attention is a subclass of the spec's own class that also records
CompPO's attention statistics when armed (``megatron_credit.models.final_layer``); the other layers
keep the plain spec.

Weights loaded from a checkpoint need no random initialisation: build with
``transformer_config_from_hf(..., perform_initialization=False)`` (a 32B stage otherwise spends minutes
per rank drawing weights it overwrites). megatron sets the ``tensor_model_parallel`` /
``partition_dim`` / ``partition_stride`` attributes of its own TP layers only in that init path, and
its gradient-norm and clipping count a TP-sharded weight without them once, on TP rank 0 only;
:func:`build_gpt_model` sets them as the init path would (:func:`set_tensor_parallel_attributes`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Optional

from megatron_credit.models.hf_config import rope_settings


@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and CUDA is usable."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "use the local spec"
        return False
    return True


def use_transformer_engine_spec(requested: Optional[bool], *, cuda: bool, te_available: bool) -> bool:
    """Whether to build the TE spec: ``requested`` (None = "auto", the recipe's ``model.transformer_impl``).

    "auto" is TE on GPU and the local spec on CPU; on a GPU without TE it is refused (ValueError)
    rather than silently falling back. An explicit request is honoured (TE without TE is refused).

    >>> use_transformer_engine_spec(None, cuda=False, te_available=False)
    False
    >>> use_transformer_engine_spec(False, cuda=True, te_available=False)
    False
    >>> use_transformer_engine_spec(None, cuda=True, te_available=False)
    Traceback (most recent call last):
    ...
    ValueError: Transformer Engine is not importable on this GPU machine, and megatron's local spec keeps full fp32 attention score matrices (~10 GB per layer at 20K tokens): install transformer-engine[pytorch] (pip install 'megatron-credit[gpu]'), or set model.transformer_impl=local to run the local spec anyway
    """
    if requested is None:
        if cuda and not te_available:
            raise ValueError("Transformer Engine is not importable on this GPU machine, and megatron's local spec "
                             "keeps full fp32 attention score matrices (~10 GB per layer at 20K tokens): install "
                             "transformer-engine[pytorch] (pip install 'megatron-credit[gpu]'), or set "
                             "model.transformer_impl=local to run the local spec anyway")
        return cuda
    if requested and not te_available:
        raise ValueError("model.transformer_impl=transformer_engine, but Transformer Engine is not importable "
                         "(or CUDA is not available)")
    return bool(requested)


def resolve_transformer_engine(requested: Optional[bool]) -> bool:
    """:func:`use_transformer_engine_spec` on this machine: whether ``build_gpt_model`` builds the TE spec for
    ``requested`` (the recipe's ``model.use_transformer_engine()``). The actor asks before it builds its
    ``TransformerConfig``, whose fused kernels follow the spec (``models/fused_kernels.py``)."""
    import torch

    return use_transformer_engine_spec(requested, cuda=torch.cuda.is_available(),
                                       te_available=transformer_engine_available() if requested is not False else False)


def gpt_layer_spec(transformer_config, *, use_transformer_engine: Optional[bool] = None,
                   packed_sequences: bool = False, unfused_norms: bool = False):
    """The ``ModuleSpec`` of one decoder layer for ``transformer_config``.

    ``use_transformer_engine``: None chooses by :func:`use_transformer_engine_spec` ("auto").
    ``packed_sequences``: the model runs packed (THD) micro-batches; TE's attention takes them as they are,
    the local spec's core attention becomes ``CpuContextParallelAttention`` (megatron's asserts they are absent).
    ``unfused_norms`` (LoRA, ``models/lora.py``): TE's spec with its norms apart from ``linear_qkv`` and
    ``linear_fc1`` (``TENorm`` + ``TEColumnParallelLinear``, as its MoE layers have them), so an adapter on those
    linears reads the normalised input; the local spec has them apart already.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    use_transformer_engine = resolve_transformer_engine(use_transformer_engine)
    # The family's spec choices, as its TransformerConfig fields state them (families/<family>.py):
    # per-head q/k norms, and routed experts (None: a dense MLP) with or without grouped GEMM
    # (models/hf_config.transformer_config_from_hf: TE's TEGroupedMLP with the TE spec).
    if transformer_config.moe_grouped_gemm and not use_transformer_engine:
        # megatron's local spec would build its legacy GroupedMLP (the grouped_gemm package, GPU only)
        raise ValueError("moe_grouped_gemm=True needs the Transformer Engine spec (TEGroupedMLP); the local spec "
                         "builds SequentialMLP: build the TransformerConfig with transformer_engine=False")
    choices = dict(qk_layernorm=transformer_config.qk_layernorm, num_experts=transformer_config.num_moe_experts,
                   moe_grouped_gemm=transformer_config.moe_grouped_gemm)
    if use_transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(**choices)
        return _te_unfused_norms(spec) if unfused_norms else spec
    spec = get_gpt_layer_local_spec(**choices, normalization=transformer_config.normalization)
    if transformer_config.sequence_parallel:
        spec = _with_sequence_parallel_norms(spec)
    if transformer_config.context_parallel_size > 1 or packed_sequences:
        from megatron_credit.models.cpu_attention import CpuContextParallelAttention

        spec = copy.deepcopy(spec)
        # 0.16.1 - 0.19.2: spec.submodules.self_attention.submodules is a SelfAttentionSubmodules
        # dataclass and transformer/attention.py calls core_attention(config=, layer_number=,
        # attn_mask_type=, attention_type=, cp_comm_type=, softmax_scale=, pg_collection=).
        attention = getattr(getattr(spec.submodules, "self_attention", None), "submodules", None)
        if not hasattr(attention, "core_attention"):
            raise RuntimeError("megatron-core's local layer spec no longer has "
                               "submodules.self_attention.submodules.core_attention: the CPU "
                               "context-parallel attention cannot be placed (models/gpt.py)")
        attention.core_attention = CpuContextParallelAttention
    return spec


def _te_unfused_norms(spec):
    """A copy of TE's layer spec whose norms are modules of their own before ``linear_qkv`` / ``linear_fc1``
    (needs Transformer Engine: GPU only)."""
    from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear, TELayerNormColumnParallelLinear,
                                                             TENorm)

    spec = copy.deepcopy(spec)
    layer = spec.submodules
    attention = layer.self_attention.submodules
    if attention.linear_qkv is TELayerNormColumnParallelLinear:
        attention.linear_qkv, layer.input_layernorm = TEColumnParallelLinear, TENorm
    mlp = getattr(getattr(layer, "mlp", None), "submodules", None)
    if getattr(mlp, "linear_fc1", None) is TELayerNormColumnParallelLinear:
        mlp.linear_fc1, layer.pre_mlp_layernorm = TEColumnParallelLinear, TENorm
    return spec


def gpt_decoder_block_spec(transformer_config, *, use_transformer_engine: Optional[bool] = None,
                           final_attention_capture=None, pp_rank: Optional[int] = None,
                           packed_sequences: bool = False, unfused_norms: bool = False):
    """The decoder spec of pipeline rank ``pp_rank`` (default: this rank's).

    Without ``final_attention_capture`` it is :func:`gpt_layer_spec` (megatron repeats it per layer);
    with one (a ``models.final_layer.FinalAttentionCapture``), a ``TransformerBlockSubmodules`` whose
    GLOBAL last layer (on the last stage only) records into it; the other layers keep the plain spec.
    """
    spec = gpt_layer_spec(transformer_config, use_transformer_engine=use_transformer_engine,
                          packed_sequences=packed_sequences, unfused_norms=unfused_norms)
    local_sp = getattr(spec.submodules, "input_layernorm", None) is SequenceParallelTorchNorm
    if final_attention_capture is None and not local_sp:
        return spec
    from megatron.core import parallel_state

    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if local_sp:  # the block's final norm sees sequence shards too
        from megatron.core.transformer.transformer_block import _get_block_submodules

        spec = dataclasses.replace(_get_block_submodules(transformer_config, spec, None, pp_rank),
                                   layer_norm=SequenceParallelTorchNorm)
    if final_attention_capture is None:
        return spec
    from megatron_credit.models.final_layer import decoder_block_spec

    return decoder_block_spec(transformer_config, spec, final_attention_capture, pp_rank=pp_rank)


class SequenceParallelTorchNorm:
    """megatron's ``WrappedTorchNorm`` (a ``torch.nn`` RMSNorm / LayerNorm) that accepts sequence
    parallelism: under SP each TP rank normalises its own sequence shard, so the weight's gradient is a
    partial sum; its parameters carry ``sequence_parallel = True`` (as TE's and apex's norms set them) and
    megatron's ``finalize_model_grads`` sums them over TP. Used by the local (CPU) spec only."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the local spec's norm")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported by the local spec")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _with_sequence_parallel_norms(spec):
    """A copy of the local layer spec whose norms (input, pre-MLP, q/k) accept sequence parallelism."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = copy.deepcopy(spec)
    layer = spec.submodules
    attention = layer.self_attention.submodules
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name, None) is WrappedTorchNorm:
            setattr(owner, name, SequenceParallelTorchNorm)
    return spec


def build_gpt_model(hf_config, transformer_config, *, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, use_transformer_engine: Optional[bool] = None,
                    capture_final_attention: bool = False, final_attention_capture=None,
                    packed_sequences: bool = False, unfused_norms: bool = False):
    """A megatron ``GPTModel`` (this rank's pipeline stage) for ``hf_config``.

    ``pre_process`` / ``post_process`` default to whether this rank is the first / last pipeline
    stage (megatron ``parallel_state`` must be initialised, see ``megatron_credit.distributed``).
    ``forward(input_ids [B, S], position_ids [B, S], attention_mask=None)`` returns vocab-parallel
    logits ``[B, S, V / tp]`` on the last stage, the hidden states ``[S, B, H]`` elsewhere.

    ``capture_final_attention``: the global last layer records CompPO's attention statistics when
    ``model.final_attention_capture`` is armed (``models.final_layer``); its groups are megatron's TP
    and CP groups unless ``final_attention_capture`` (an unarmed ``FinalAttentionCapture``) is passed.
    ``model.final_attention_capture`` is None otherwise.

    ``packed_sequences``: the model also runs packed (THD) micro-batches, ``forward(input_ids [1, t],
    position_ids [1, t], None, packed_seq_params=...)`` (``batch/packing.py``); see :func:`gpt_layer_spec`.
    """
    from megatron.core import parallel_state
    # megatron-core 0.19 deprecates GPTModel (it logs "GPTModel IS DEPRECATED ... use HybridModel":
    # critical fixes only). Its replacement, megatron.core.models.hybrid.HybridModel (a layer pattern
    # such as "*-*-" over a hybrid stack spec), does not exist in 0.16.1, the last release for Python
    # 3.11, so GPTModel stays while both are supported (README: Status).
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    tp = transformer_config.tensor_model_parallel_size
    if hf_config.vocab_size % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size={tp} does not divide "
                         f"vocab_size={hf_config.vocab_size} (pad the vocabulary)")
    rope = rope_settings(hf_config)
    capture = final_attention_capture
    if capture_final_attention and capture is None:
        from megatron_credit.models.final_layer import FinalAttentionCapture

        capture = FinalAttentionCapture(
            tp_group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
            cp_group=(parallel_state.get_context_parallel_group()
                      if transformer_config.context_parallel_size > 1 else None))
    elif not capture_final_attention and capture is not None:
        raise ValueError("final_attention_capture was passed without capture_final_attention=True")
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=gpt_decoder_block_spec(transformer_config,
                                                      use_transformer_engine=use_transformer_engine,
                                                      final_attention_capture=capture,
                                                      packed_sequences=packed_sequences,
                                                      unfused_norms=unfused_norms),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope.base,
        rope_scaling=rope.llama3_scaling_factor is not None,
        rope_scaling_factor=rope.llama3_scaling_factor or 8.0,
    )
    if not transformer_config.perform_initialization:
        set_tensor_parallel_attributes(model)
    model.final_attention_capture = capture
    return model


def set_tensor_parallel_attributes(model) -> int:
    """Give megatron's own TP layers the attributes its init path sets; returns how many weights got them.

    With ``perform_initialization=False``, ``VocabParallelEmbedding``, ``ColumnParallelLinear`` and
    ``RowParallelLinear`` (megatron-core 0.16 - 0.19, ``tensor_parallel/layers.py``) skip
    ``_initialize_affine_weight_cpu/gpu`` and with it ``set_tensor_model_parallel_attributes`` on the
    weight (column-parallel biases get theirs regardless). The values are those of the init path:
    partition dim 0 for the embedding and column-parallel weights, 1 for row-parallel ones; stride 2
    for a gated MLP's ``linear_fc1`` (``transformer/mlp.py``: each rank holds [gate_r; up_r]), else 1.
    Transformer Engine layers set their own attributes whatever the init and are left alone.
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)
    from megatron.core.transformer.mlp import MLP

    gated_fc1 = {id(m.linear_fc1) for m in model.modules() if isinstance(m, MLP) and m.config.gated_linear_unit}
    count = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            dim, stride = 0, 1
        elif isinstance(module, ColumnParallelLinear):
            dim, stride = 0, 2 if id(module) in gated_fc1 else 1
        elif isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=stride)
        count += 1
    return count


@contextlib.contextmanager
def final_hidden_states(model):
    """Make the last stage return its final hidden states ``[s, b, H]`` (after the final norm) instead of
    logits: the trainer computes log-probs chunk by chunk from them and the output weight, so no
    ``[b, s, V]`` logits tensor ever exists (``trainer/actor.py``). GPTModel._postprocess returns ``hidden_states`` when
    ``post_process`` is False; the decoder keeps its own flag and still applies the final norm."""
    was = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = was
