"""Bad input at the hardware surface: a recipe that asks for CUDA, Transformer Engine or bf16 where the
machine has none is one line naming the field (``megatron_credit/recipe/device_fields.py``), before any
process group or model exists; bf16 on a CPU with bf16 instructions, and anything on a GPU that has
it, is accepted. The process group's backend is no recipe field: ``distributed.initialize`` refuses
nccl without CUDA."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_credit.recipe.config import TINY_QWEN2, recipe_from_dict
from megatron_credit.recipe.device_fields import cpu_bf16_supported, device_refusal

REPO = Path(__file__).resolve().parents[1]


def _recipe(**sections):
    return recipe_from_dict(sections)


def _yes():
    return True


def _no():
    return False


NO_CUDA = [  # (recipe sections, the line on a CPU-only machine whose CPU has no bf16)
    ({"model": {"architecture": dict(TINY_QWEN2), "transformer_impl": "transformer_engine"}},
     "model.transformer_impl=transformer_engine asks for Transformer Engine, which runs on CUDA GPUs only, and "
     "this machine has none (torch.cuda.is_available() is False): set model.transformer_impl=local (or auto: the "
     "local spec on CPU)"),
    ({"model": {"architecture": dict(TINY_QWEN2), "params_dtype": "bfloat16"}},
     "model.params_dtype=bfloat16 asks for bf16 arithmetic, which this machine's CPU does not have (no "
     "avx512_bf16, amx_bf16 or ARM bf16): set model.params_dtype=float32 (or auto: float32 on CPU)"),
    ({"rollout": {"engine_options": {"weight_transfer": "cuda_ipc"}}},
     "rollout.engine_options.weight_transfer=cuda_ipc sends CUDA IPC handles, and this machine has no CUDA "
     "device: set rollout.engine_options.weight_transfer=in_process (or leave it unset)"),
    ({"rollout": {"engine_options": {"device": "cuda:0"}}},
     "rollout.engine_options.device=cuda:0 asks for CUDA, and this machine has none: leave it unset (the engine "
     "runs on the trainer's device)"),
    ({"model": {"architecture": dict(TINY_QWEN2)},
      "parallel": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}},
     "parallel.expert_model_parallel_size=2 with expert tensor parallelism 2 (parallel.tensor_model_parallel_size): "
     "megatron's expert dispatcher all-gathers uneven token counts over the expert-TP ranks, which gloo cannot, "
     "and this machine has no CUDA device: on CPU use expert parallelism with parallel.tensor_model_parallel_size=1"),
    ({"train": {"recompute": "full"}},
     "train.recompute=full: megatron's activation checkpoint saves the CUDA RNG state, and this machine has no "
     "CUDA device: set train.recompute=null on CPU"),
    ({"train": {"recompute": "selective"}},
     "train.recompute=selective: megatron's activation checkpoint saves the CUDA RNG state, and this machine has "
     "no CUDA device: set train.recompute=null on CPU"),
]


@pytest.mark.parametrize("i", range(len(NO_CUDA)))
def test_cpu_only_machine_names_the_field(i):
    sections, line = NO_CUDA[i]
    assert device_refusal(_recipe(**sections), cuda=False, bf16=_no, te=_yes) == line


def test_bf16_on_a_cpu_with_bf16_and_the_defaults_are_accepted():
    bf16 = _recipe(model={"architecture": dict(TINY_QWEN2), "params_dtype": "bfloat16"})
    assert device_refusal(bf16, cuda=False, bf16=_yes, te=_no) is None
    # auto is float32 on CPU whatever the checkpoint says: nothing asked for
    auto = _recipe(model={"architecture": {**TINY_QWEN2, "torch_dtype": "bfloat16"}})
    assert device_refusal(auto, cuda=False, bf16=_no, te=_no) is None
    assert device_refusal(_recipe(), cuda=False, bf16=_no, te=_no) is None
    assert device_refusal(_recipe(rollout={"engine_options": {"weight_transfer": "in_process"}}), cuda=False,
                          bf16=_no, te=_no) is None


def test_gpu_without_bf16_or_te():
    auto = _recipe(model={"architecture": {**TINY_QWEN2, "torch_dtype": "bfloat16"}})
    assert device_refusal(auto, cuda=True, bf16=_no, te=_yes) == (
        "model.params_dtype=auto (the checkpoint's bfloat16) asks for bf16 arithmetic, which a CUDA GPU does not "
        "have (torch.cuda.is_bf16_supported() is False): set model.params_dtype=float16 or float32")
    assert device_refusal(auto, cuda=True, bf16=_yes, te=_yes) is None
    assert device_refusal(_recipe(train={"recompute": "full"}), cuda=True, bf16=_yes, te=_yes) is None
    te = _recipe(model={"architecture": dict(TINY_QWEN2), "transformer_impl": "transformer_engine"})
    assert device_refusal(te, cuda=True, bf16=_yes, te=_no) == (
        "model.transformer_impl=transformer_engine, but Transformer Engine does not import here: install it (pip "
        "install --no-build-isolation 'transformer_engine[pytorch]', or use an NGC PyTorch container) or set "
        "model.transformer_impl=local")
    assert device_refusal(te, cuda=True, bf16=_yes, te=_yes) is None
    # CUDA fields are fine where CUDA is
    ipc = _recipe(rollout={"engine_options": {"weight_transfer": "cuda_ipc", "device": "cuda"}})
    assert device_refusal(ipc, cuda=True, bf16=_yes, te=_yes) is None


def test_cpu_bf16_follows_torchs_capabilities(monkeypatch):
    caps = dict(torch.cpu.get_capabilities())
    assert cpu_bf16_supported() == any(caps.get(f, False) for f in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    assert cpu_bf16_supported() is False
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "aarch64", "bf16": True})
    assert cpu_bf16_supported() is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only CLI path")
@pytest.mark.dist
def test_trainer_cli_prints_one_line_before_building_anything(tmp_path):
    """pretrain_rl.py with the demo recipe asking for Transformer Engine: exit 2, one line naming the
    field, no run directory."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "pretrain_rl.py", "--config", "examples/demo_cpu.yaml",
                           "--output-dir", str(out), "model.transformer_impl=transformer_engine"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        "error: model.transformer_impl=transformer_engine asks for Transformer Engine, which runs on CUDA GPUs only")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_nccl_without_cuda_is_refused():
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    if torch.distributed.is_initialized():
        pytest.skip("a process group exists already")
    with pytest.raises(ValueError, match=r"^backend='nccl' needs CUDA, and this machine has none "
                                         r"\(torch.cuda.is_available\(\) is False\): use gloo"):
        distributed.initialize(ParallelConfig(), seed=0, backend="nccl")
    assert not torch.distributed.is_initialized()
