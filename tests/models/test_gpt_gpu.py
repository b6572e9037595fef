"""GPU tests of the actor build (Transformer Engine spec). NOT RUN on the CPU machines it was written on.

The TE spec gives the local spec's logits for the same weights, and a TE model built without random
initialisation (weights from a checkpoint) keeps the tensor-parallel attributes megatron's gradient
norm relies on. ``tools/gpu_check.py te_vs_local`` reports the numbers, gradients included. A
mixture of experts under the TE spec runs its experts as TE's grouped GEMM (``TEGroupedMLP``): its
parameters carry the converter's grouped names, it gives the local spec's ``SequentialMLP`` logits, and
its forward and backward take less time than ``SequentialMLP``'s one GEMM per expert.
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


def test_moe_te_spec_is_grouped_gemm_under_the_converters_names(world1):
    """Qwen3-MoE (4 experts, top-2): ``TEGroupedMLP`` under the TE spec, ``SequentialMLP`` under the local one,
    both loaded from the same HF weights by ``load_hf_into_local_state``; the grouped model's parameter names
    are ``expand_rules(..., grouped_experts=True)``'s, its logits the local model's, its buckets the HF weights."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from transformers import AutoModelForCausalLM

    from megatron_credit.conversion import family_for_config, iter_hf_weight_buckets
    from megatron_credit.conversion.streaming import expand_rules
    from megatron_credit.conversion.testing import checkpoint_state
    from tools.gpu_check import _build_loaded, _tiny_hf

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cfg = _tiny_hf("qwen3_moe")
    fam = family_for_config(cfg)
    torch.manual_seed(0)
    hf = checkpoint_state(AutoModelForCausalLM.from_config(cfg).state_dict())
    models = {te: _build_loaded(cfg, hf, te=te, dtype=torch.float32) for te in (False, True)}
    experts = {te: {type(m) for m in model.modules() if isinstance(m, (SequentialMLP, TEGroupedMLP))}
               for te, model in models.items()}
    assert experts == {False: {SequentialMLP}, True: {TEGroupedMLP}}
    names = {n for n, _ in models[True].named_parameters()}
    assert names == {n for n, _, _ in expand_rules(fam, cfg, fused_norms=True, grouped_experts=True)}
    ids = torch.randint(0, 160, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(32, device="cuda").expand(2, -1)
    with torch.no_grad():
        local, te = (models[k](ids, pos, None).float() for k in (False, True))
    assert ((local - te).abs().max() / local.abs().max()).item() < 2e-3
    out = {n: t.cpu() for b in iter_hf_weight_buckets(models[True].state_dict(), fam, cfg) for n, t in b}
    assert sorted(out) == sorted(hf) and all(torch.equal(out[n], hf[n]) for n in hf)


def _moe_layer_ms(grouped: bool) -> float:
    """Best forward + backward ms of one bf16 decoder layer shaped as one EP-8 rank's share of a Qwen3-30B-A3B
    layer (h 2048, 16 local experts of I_e 768, top-8), 4,096 tokens, TE spec."""
    from megatron_credit.conversion.testing import tiny_hf_config
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from megatron_credit.recipe.config import ParallelConfig
    from tools.gpu_check import _best_ms

    cfg = tiny_hf_config("qwen3_moe", vocab_size=1024, hidden_size=2048, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=16,
                         num_experts_per_tok=8, max_position_embeddings=4096)
    tc = transformer_config_from_hf(cfg, parallel=ParallelConfig(), params_dtype=torch.bfloat16, transformer_engine=True,
                                    use_cpu_initialization=False, gradient_accumulation_fusion=False,
                                    moe_grouped_gemm=grouped)
    model = build_gpt_model(cfg, tc, use_transformer_engine=True).cuda()
    ids = torch.randint(0, 1024, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(4096, device="cuda")[None]

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, pos, None).float().sum().backward()

    return _best_ms(step)


def test_grouped_experts_are_faster_than_one_gemm_per_expert(world1):
    grouped, sequential = _moe_layer_ms(True), _moe_layer_ms(False)
    assert grouped < sequential, f"TEGroupedMLP {grouped:.1f} ms, SequentialMLP {sequential:.1f} ms"
