"""Which of megatron-core's fused kernels the actor's ``TransformerConfig`` turns on, and what each needs.

Read against megatron-core 0.16.1 (installed) and 0.19 (the GPU containers):

| flag | what it needs | what it saves |
| --- | --- | --- |
| ``apply_rope_fusion`` | TE's fused RoPE: megatron's ``rope_utils.fused_apply_rotary_pos_emb_thd`` is not None (``TransformerConfig.__post_init__`` refuses the flag otherwise); under CP, TE >= 1.12 (``extensions/transformer_engine.py`` asserts ``cp_size == 1`` below it) | megatron's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``) calls ``.tolist()`` and ``.item()`` on ``cu_seqlens``: host syncs for q and k in every layer of every micro-batch, and again in the recompute. TE's kernel reads ``cu_seqlens`` where it lies: on the device (``trainer/batch.py`` puts it there) |
| ``bias_activation_fusion`` | SwiGLU or GeLU (``TransformerConfig`` and ``transformer/mlp.py`` refuse other activations), ``use_te_activation_func`` off; megatron fuses with ``jit_fuser`` (``torch.compile``), which needs a GPU backend to pay off | one kernel for the bias and the gated activation of every MLP |
| ``gradient_accumulation_fusion`` | a ``main_grad`` on every trainable weight (megatron DDP's, ``distributed/grads.wrap_ddp``; every actor is wrapped); TE's linears fuse into it themselves (``fuse_wgrad_accumulation``), but megatron's own ``ColumnParallelLinear`` (the output layer, also under the TE spec) needs apex's ``fused_weight_gradient_mlp_cuda`` and raises ``RuntimeError`` without it | the weight-gradient GEMM accumulates straight into the fp32 ``main_grad`` (no bf16 ``.grad`` and no separate add) |

On the local spec (CPU, or ``model.transformer_impl: local``) all three stay off: ``torch.compile`` on CPU costs
minutes of compilation for a two-core test, the unfused THD RoPE is exact there, and nothing provides the
wgrad kernels. The probes import Transformer Engine / apex only when called (docs/architecture.md, convention 6).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedKernels:
    """The fused-kernel flags of megatron's ``TransformerConfig`` that the actor sets."""

    apply_rope_fusion: bool = False
    """TE's fused RoPE, which takes ``cu_seqlens`` on the device (no host sync per layer)."""
    bias_activation_fusion: bool = False
    """One fused kernel for the MLP's bias and SwiGLU."""
    gradient_accumulation_fusion: bool = False
    """Weight-gradient GEMMs accumulate into DDP's fp32 ``main_grad``."""

    def overrides(self) -> dict[str, bool]:
        """The ``TransformerConfig`` keyword arguments."""
        return dataclasses.asdict(self)


def te_fused_rope_available(*, context_parallel_size: int) -> bool:
    """Whether megatron finds TE's fused THD RoPE (and, under CP, a TE recent enough to split it by CP rank)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        return False
    if context_parallel_size > 1:
        from megatron.core.utils import is_te_min_version

        return is_te_min_version("1.12.0")
    return True


def apex_wgrad_fusion_available() -> bool:
    """Whether apex's ``fused_weight_gradient_mlp_cuda`` imports (megatron's own linears need it to fuse)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def fused_kernels(*, transformer_engine: bool, context_parallel_size: int, swiglu: bool) -> FusedKernels:
    """The flags for a model built with the TE spec (``transformer_engine``) or the local one (all off).

    ``swiglu``: the MLP is gated SiLU (every family this project converts). Each flag is on only where what it
    needs is present (the module docstring's table); the probes run here, lazily.
    """
    if not transformer_engine:
        return FusedKernels()
    return FusedKernels(
        apply_rope_fusion=te_fused_rope_available(context_parallel_size=context_parallel_size),
        bias_activation_fusion=swiglu,
        gradient_accumulation_fusion=apex_wgrad_fusion_available(),
    )
