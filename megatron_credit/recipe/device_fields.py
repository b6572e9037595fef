"""The recipe fields that ask for hardware, checked against this machine before anything is built.

A recipe asks for CUDA, Transformer Engine or bf16 through these fields (the process group's backend is
no recipe field: ``distributed.default_backend`` picks nccl exactly when CUDA is usable, and
``distributed.initialize(backend="nccl")`` without CUDA is refused there):

- ``model.transformer_impl: transformer_engine``: Transformer Engine, which runs on CUDA GPUs only;
- ``model.params_dtype: bfloat16`` (or ``auto`` resolving to a checkpoint's bfloat16 on a GPU): bf16
  arithmetic. A CPU with native bf16 instructions (x86 ``avx512_bf16`` / ``amx_bf16``, ARM ``bf16`` /
  ``sve_bf16``) runs it and is accepted; a GPU must report ``torch.cuda.is_bf16_supported()``;
- ``rollout.engine_options.weight_transfer: cuda_ipc`` and ``rollout.engine_options.device: cuda...``:
  CUDA itself;
- ``parallel.expert_model_parallel_size`` above 1 with expert tensor parallelism (``expert_tp``, the TP size
  by default) above 1: megatron's all-to-all dispatcher all-gathers each rank's tokens over the expert-TP
  ranks in uneven sizes, which NCCL does and gloo refuses ("invalid tensor size");
- ``train.recompute: full | selective``: megatron's activation checkpoint (of whole layers, or of the
  core attention) saves and restores the CUDA RNG state (``tensor_parallel.random.CheckpointFunction``),
  which needs CUDA.

Where the machine lacks it, :func:`check_device_fields` raises one ValueError naming the field, what
it asks for and what to set instead. ``--dry-run`` does not call it: it plans a recipe for its
target cluster (``cluster.gpu``) from any machine.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def cpu_bf16_supported() -> bool:
    """Whether this CPU has native bf16 instructions (torch's detected capabilities)."""
    caps = torch.cpu.get_capabilities()
    return any(bool(caps.get(flag, False)) for flag in _CPU_BF16_FLAGS)


def transformer_engine_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (any import failure: not usable)
        return False
    return True


def device_refusal(recipe, *, cuda: bool, bf16: Callable[[], bool],
                   te: Callable[[], bool] = transformer_engine_importable) -> Optional[str]:
    """The one-line refusal for the first hardware field ``recipe`` asks for that this machine lacks,
    or None. ``cuda``: whether CUDA is usable; ``bf16``: whether this device (GPU when ``cuda``, else
    the CPU) has bf16 arithmetic; ``te``: whether Transformer Engine imports."""
    where = "a CUDA GPU" if cuda else "this machine's CPU"
    model = recipe.model
    if model.transformer_impl == "transformer_engine":
        if not cuda:
            return ("model.transformer_impl=transformer_engine asks for Transformer Engine, which runs on CUDA GPUs "
                    "only, and this machine has none (torch.cuda.is_available() is False): set "
                    "model.transformer_impl=local (or auto: the local spec on CPU)")
        if not te():
            return ("model.transformer_impl=transformer_engine, but Transformer Engine does not import here: install "
                    "it (pip install --no-build-isolation 'transformer_engine[pytorch]', or use an NGC PyTorch "
                    "container) or set model.transformer_impl=local")
    options = dict(recipe.rollout.engine_options or {})
    if not cuda:
        if options.get("weight_transfer") == "cuda_ipc":
            return ("rollout.engine_options.weight_transfer=cuda_ipc sends CUDA IPC handles, and this machine has no "
                    "CUDA device: set rollout.engine_options.weight_transfer=in_process (or leave it unset)")
        device = options.get("device")
        if isinstance(device, (str, torch.device)) and str(device).startswith("cuda"):
            return (f"rollout.engine_options.device={device} asks for CUDA, and this machine has none: leave it unset "
                    "(the engine runs on the trainer's device)")
    p = recipe.parallel
    if not cuda and p.expert_model_parallel_size > 1 and p.expert_tp > 1:
        return (f"parallel.expert_model_parallel_size={p.expert_model_parallel_size} with expert tensor parallelism "
                f"{p.expert_tp} (parallel.tensor_model_parallel_size): megatron's expert dispatcher all-gathers "
                "uneven token counts over the expert-TP ranks, which gloo cannot, and this machine has no CUDA "
                "device: on CPU use expert parallelism with parallel.tensor_model_parallel_size=1")
    if not cuda and recipe.train.recompute:
        return (f"train.recompute={recipe.train.recompute}: megatron's activation checkpoint saves the CUDA RNG "
                "state, and this machine has no CUDA device: set train.recompute=null on CPU")
    if model.params_dtype == "bfloat16" or (cuda and model.params_dtype == "auto"
                                            and model.torch_dtype(cuda=True) == torch.bfloat16):
        if not bf16():
            field = "model.params_dtype=bfloat16" if model.params_dtype == "bfloat16" else \
                "model.params_dtype=auto (the checkpoint's bfloat16)"
            hint = ("set model.params_dtype=float16 or float32" if cuda else
                    "set model.params_dtype=float32 (or auto: float32 on CPU)")
            return (f"{field} asks for bf16 arithmetic, which {where} does not have"
                    f"{' (torch.cuda.is_bf16_supported() is False)' if cuda else ' (no avx512_bf16, amx_bf16 or ARM bf16)'}"
                    f": {hint}")
    return None


def check_device_fields(recipe) -> None:
    """:func:`device_refusal` on this machine; ValueError (one line) when it refuses."""
    cuda = torch.cuda.is_available()
    refusal = device_refusal(recipe, cuda=cuda, bf16=torch.cuda.is_bf16_supported if cuda else cpu_bf16_supported)
    if refusal is not None:
        raise ValueError(refusal)
