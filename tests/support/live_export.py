"""Weight export from live megatron models for the tests of ``conversion/live.py``: the tiny HF state of a
family and the real-GPTModel export at a TP / PP layout (run inside a ``DistributedPool`` worker), shared
by test_live and test_tp_exceeds_kv_heads."""
from __future__ import annotations

import torch

BUCKET = 12_000  # bytes: several buckets for the tiny models, some tensors alone in a bucket


def _hf_state(family: str, tied: bool):
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion.testing import tiny_hf_config

    cfg = tiny_hf_config(family, vocab_size=160, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    return cfg, state


def _export_real_model(family: str, tp: int, pp: int):
    """The same generator on a real megatron GPTModel loaded from HF weights at TP/PP.

    Returns the exported HF tensors and this rank's own tied-head copy gathered over TP (the last
    stage's ``output_layer.weight`` at PP > 1, padding rows dropped), or None where there is none.
    """
    from megatron.core import parallel_state as ps

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.conversion import family_for_config, iter_hf_weight_buckets, load_hf_into_local_state
    from megatron_credit.conversion.model_io import build_model

    distributed.initialize(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    try:
        cfg, hf = _hf_state(family, tied=(family == "llama"))  # PP=2: the last stage holds a head copy
        model = build_model(cfg, params_dtype=torch.float32, tp=tp, pp=pp)
        offset = ps.get_pipeline_model_parallel_rank() * cfg.num_hidden_layers // pp
        fam = family_for_config(cfg)
        load_hf_into_local_state(model.state_dict(keep_vars=True), hf.__getitem__, fam, cfg,
                                 tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp, layer_offset=offset)
        out = {}
        for bucket in iter_hf_weight_buckets(model.state_dict(), fam, cfg,
                                             tp_group=ps.get_tensor_model_parallel_group(),
                                             pp_group=ps.get_pipeline_model_parallel_group(), layer_offset=offset,
                                             bucket_bytes=BUCKET):
            out.update((n, t.clone()) for n, t in bucket)
        head = model.state_dict().get("output_layer.weight") if cfg.tie_word_embeddings else None
        if head is not None:
            parts = [torch.empty_like(head) for _ in range(tp)]
            torch.distributed.all_gather(parts, head.contiguous(), group=ps.get_tensor_model_parallel_group())
            head = torch.cat(parts)[:cfg.vocab_size].clone()
        return out, head
    finally:
        distributed.destroy()
