"""Hugging Face config -> megatron-core actor.

Public API:

- ``transformer_config_from_hf(hf_config, *, parallel, params_dtype=torch.float32, **overrides)``:
  a megatron ``TransformerConfig`` with the architecture of a Qwen2 / Qwen2.5 / Qwen3 / Llama 3 / Mistral
  ``transformers`` config (GQA, RoPE, SwiGLU, RMSNorm, QKV bias, q/k norm) and the TP / PP / CP /
  sequence-parallel sizes of ``parallel`` (a ``megatron_credit.recipe.config.ParallelConfig``). Refuses,
  before anything is built, a model that ``parallel`` cannot shard (``ValueError`` naming the field).
- ``build_gpt_model(hf_config, transformer_config, *, pre_process=None, post_process=None)``: the
  megatron ``GPTModel`` of this rank's pipeline stage (TE spec when Transformer Engine imports, local
  spec otherwise; CPU context-parallel attention for CP > 1 with the local spec); tied embeddings
  follow ``hf_config.tie_word_embeddings``. Needs megatron ``parallel_state`` initialised
  (``megatron_credit.distributed.initialize``). Returns vocab-parallel logits ``[B, S, V/tp]``.
- ``build_gpt_model(..., capture_final_attention=True)``: the global last decoder layer also records
  CompPO's attention statistics when ``model.final_attention_capture`` (a ``FinalAttentionCapture``) is
  armed: ``arm(query_start, top_k)``, forward, ``.result`` (``H``, ``n``, ``topk_idx``, ``topk_w`` for
  global positions ``query_start .. S-1``, identical on every TP / CP rank), ``disarm()``
  (:mod:`megatron_credit.models.final_layer`); ``gpt_decoder_block_spec`` is its per-stage spec.
- ``attention_concentration(query, key, *, scale, chunk_size, tp_group, q_positions) -> (H, n)`` and
  ``attention_topk(query, key, k, ...) -> (idx, weight)``: the streamed kernels, and
  ``attention_statistics(query, key, k, ...) -> (H, n, idx, weight)``, both from one first pass
  (:mod:`megatron_credit.models.concentration`; torch only).
- ``check_parallel_fits_model(hf_config, parallel, *, world_size=None)``, ``rope_settings(hf_config)``,
  ``check_sequence_length(hf_config, length, *, what)`` (refuses sequences beyond
  ``max_position_embeddings``), ``use_transformer_engine_spec`` (TE on GPU, refused fallback),
  ``set_tensor_parallel_attributes(model)`` (what megatron's skipped init would have set; applied by
  ``build_gpt_model`` when ``perform_initialization=False``), ``resolve_transformer_engine(requested)``
  (the spec ``build_gpt_model`` builds here; ``transformer_config_from_hf(..., transformer_engine=True)``
  turns on the fused kernels that spec has, :mod:`megatron_credit.models.fused_kernels`).

- ``TransportAlignedCritic``, ``StandardCritic``, ``build_critic``, ``critic_parameter_count``,
  ``critic_diagnostics`` (``models/critic.py``): CompPO's value heads on the actor's detached features.

Importing this package imports torch only; megatron-core is imported when a model is built.
"""
from megatron_credit.models.critic import (StandardCritic, TransportAlignedCritic, build_critic,
                                           critic_diagnostics, critic_parameter_count)
from megatron_credit.models.concentration import attention_concentration, attention_statistics, attention_topk
from megatron_credit.models.final_layer import FinalAttentionCapture
from megatron_credit.models.gpt import (build_gpt_model, final_hidden_states, gpt_decoder_block_spec,
                                        gpt_layer_spec, resolve_transformer_engine, set_tensor_parallel_attributes,
                                        transformer_engine_available, use_transformer_engine_spec)
from megatron_credit.models.hf_config import (
    SUPPORTED_MODEL_TYPES, RopeSettings, actor_transformer_config, check_parallel_fits_model, check_sequence_length, head_dim,
    rope_settings, transformer_config_from_hf)

__all__ = [
    "FinalAttentionCapture", "SUPPORTED_MODEL_TYPES", "RopeSettings", "actor_transformer_config",
    "attention_concentration", "attention_statistics", "attention_topk",
    "StandardCritic", "TransportAlignedCritic", "build_critic", "build_gpt_model",
    "critic_diagnostics", "critic_parameter_count", "check_parallel_fits_model", "check_sequence_length",
    "final_hidden_states", "gpt_decoder_block_spec",
    "gpt_layer_spec", "head_dim", "resolve_transformer_engine", "rope_settings", "set_tensor_parallel_attributes",
    "transformer_config_from_hf", "transformer_engine_available", "use_transformer_engine_spec",
]
