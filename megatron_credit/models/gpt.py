"""The megatron ``GPTModel`` for a Hugging Face config: layer spec choice and model construction.

Spec: Transformer Engine's when ``transformer_engine`` imports and CUDA is present (untested here:
TE cannot be installed on the CPU development machines), else megatron's local spec on CPU and GPU
alike. Context parallelism needs TE's ring attention; with the local spec, core attention is swapped
for ``CpuContextParallelAttention`` (megatron's ``DotProductAttention`` asserts
``context_parallel_size == 1``).
"""
from __future__ import annotations

import copy
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


def gpt_layer_spec(transformer_config, *, use_transformer_engine: Optional[bool] = None):
    """The ``ModuleSpec`` of one decoder layer for ``transformer_config``."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=transformer_config.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=transformer_config.qk_layernorm,
                                    normalization=transformer_config.normalization)
    if transformer_config.context_parallel_size > 1:
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


def build_gpt_model(hf_config, transformer_config, *, pre_process: Optional[bool] = None,
                    post_process: Optional[bool] = None, use_transformer_engine: Optional[bool] = None):
    """A megatron ``GPTModel`` (this rank's pipeline stage) for ``hf_config``.

    ``pre_process`` / ``post_process`` default to whether this rank is the first / last pipeline
    stage (megatron ``parallel_state`` must be initialised, see ``megatron_credit.distributed``).
    ``forward(input_ids [B, S], position_ids [B, S], attention_mask=None)`` returns vocab-parallel
    logits ``[B, S, V / tp]`` on the last stage, the hidden states ``[S, B, H]`` elsewhere.
    """
    from megatron.core import parallel_state
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
    return GPTModel(
        config=transformer_config,
        transformer_layer_spec=gpt_layer_spec(transformer_config,
                                              use_transformer_engine=use_transformer_engine),
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
