"""GPU tests of the actor build (Transformer Engine spec). NOT RUN on the CPU machines it was written on.

The TE spec gives the local spec's logits for the same weights, and a TE model built without random
initialisation (weights from a checkpoint) keeps the tensor-parallel attributes megatron's gradient
norm relies on. ``tools/gpu_check.py te_vs_local`` reports the numbers, gradients included.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def world1():
    pytest.importorskip("transformer_engine")
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    distributed.initialize(ParallelConfig(), seed=0)
    yield
    distributed.destroy(process_group=True)


def _models(**kw):
    from transformers import AutoModelForCausalLM

    from tools.gpu_check import _build_loaded, _tiny_hf

    cfg = _tiny_hf()
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(cfg).state_dict()
    return cfg, {te: _build_loaded(cfg, state, te=te, dtype=torch.float32, **kw) for te in (False, True)}


def test_te_spec_logits_equal_the_local_spec(world1):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    _, models = _models()
    ids = torch.randint(0, 160, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(32, device="cuda").expand(2, -1)
    with torch.no_grad():
        local, te = (models[k](ids, pos, None).float() for k in (False, True))
    assert ((local - te).abs().max() / local.abs().max()).item() < 2e-3


def test_te_spec_without_init_keeps_tensor_parallel_attributes(world1):
    attrs = ("tensor_model_parallel", "partition_dim", "partition_stride")
    _, with_init = _models(init=True)
    _, without = _models(init=False)
    for te in (False, True):
        want = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in with_init[te].named_parameters()}
        got = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in without[te].named_parameters()}
        assert got == want, te
