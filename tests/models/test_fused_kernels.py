"""The fused kernels of the actor's ``TransformerConfig`` (``models/fused_kernels.py``): on under the TE spec where
TE and apex provide them, off on the local (CPU) spec; and the packed micro-batch hands ``cu_seqlens`` to the
fused RoPE on the device. TE and apex are absent here: their probes are set to "present" (megatron's own check
of the RoPE flag reads the same attribute, so a config it accepts is a config it would build on a GPU)."""
from __future__ import annotations

import pytest
import torch

from megatron_credit.models import actor_transformer_config, transformer_config_from_hf
from megatron_credit.recipe.config import ModelConfig, ParallelConfig

FLAGS = ("apply_rope_fusion", "bias_activation_fusion", "gradient_accumulation_fusion")
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def _flags(tc) -> tuple[bool, ...]:
    return tuple(getattr(tc, f) for f in FLAGS)


@pytest.fixture
def te_present(monkeypatch):
    """TE's fused RoPE and apex's wgrad extension, as megatron and our probes look for them."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_credit.models import fused_kernels

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)
    monkeypatch.setattr(fused_kernels, "apex_wgrad_fusion_available", lambda: True)
    return fused_kernels


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_the_te_path_turns_the_fused_kernels_on(te_present, model_type):
    hf = ModelConfig(architecture=dict(model_type=model_type, **TINY)).hf_config()
    tc = actor_transformer_config(hf, parallel=ParallelConfig(), params_dtype=torch.bfloat16, recompute="full",
                                  transformer_engine=True)
    assert _flags(tc) == (True, True, True)
    assert tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu and not tc.use_te_activation_func
    # the local spec (CPU, or model.transformer_impl=local) keeps all three off, whatever is installed
    assert _flags(actor_transformer_config(hf, parallel=ParallelConfig(), params_dtype=torch.bfloat16)) == (False,) * 3
    assert _flags(transformer_config_from_hf(hf, parallel=ParallelConfig())) == (False,) * 3


def test_each_flag_follows_what_provides_it(te_present, monkeypatch):
    import megatron.core.utils as mutils
    from megatron.core.models.common.embeddings import rope_utils

    hf = ModelConfig(architecture=dict(model_type="qwen2", **TINY)).hf_config()

    def te_config(**parallel):
        return transformer_config_from_hf(hf, parallel=ParallelConfig(**parallel), transformer_engine=True)

    # without apex, megatron's own output layer (a ColumnParallelLinear) would raise: TE alone does not fuse
    monkeypatch.setattr(te_present, "apex_wgrad_fusion_available", lambda: False)
    assert _flags(te_config()) == (True, True, False)
    # TE < 1.12 cannot split the fused THD RoPE by CP rank (megatron asserts cp_size == 1 there)
    monkeypatch.setattr(mutils, "is_te_min_version", lambda version, **_: False)  # a TE older than any asked
    assert _flags(te_config(context_parallel_size=2)) == (False, True, False)
    assert _flags(te_config()) == (True, True, False)
    # no fused RoPE in TE at all: the flag stays off (megatron would refuse it)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    assert _flags(te_config()) == (False, True, False)


def test_the_real_probes_find_neither_te_nor_apex_here():
    from megatron_credit.models import fused_kernels, resolve_transformer_engine

    assert resolve_transformer_engine(None) is False  # CPU: the local spec, so the actor's flags are off
    assert fused_kernels.te_fused_rope_available(context_parallel_size=1) is False
    assert fused_kernels.apex_wgrad_fusion_available() is False


def test_packed_micro_batches_hand_cu_seqlens_on_the_device():
    # TE's fused THD RoPE and attention read cu_seqlens on the device; the host copy serves host-side readers
    from megatron_credit.batch.packing import PackedIndex
    from megatron_credit.batch.train_batch import MicroBatch

    index = PackedIndex.build([3, 5, 2], multiple=4)
    device = torch.device("meta")  # any device but the CPU's
    mb = MicroBatch(rows=(0, 1, 2), num_rows=3, seq_len=8, position_ids=torch.zeros(1, index.total_tokens,
                    dtype=torch.long, device=device), tensors={}, whole_loss_mask=torch.ones(3, 8), packing=index)
    params = mb.packed_seq_params
    for cu in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
        assert cu.device == device and cu.dtype == torch.int32 and tuple(cu.shape) == (4,)
    assert params.cu_seqlens_host == (0, 4, 12, 16) and params.qkv_format == "thd" and params.max_seqlen_q == 8
