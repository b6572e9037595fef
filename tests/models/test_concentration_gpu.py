"""GPU checks of CompPO's attention statistics. NOT RUN on the CPU machines they were written on (the
task that wrote them drew no GPU): run ``pytest -q tests/models/test_concentration_gpu.py`` on a GPU node.

- the issue's memory bound at its full size, measured exactly (``torch.cuda.max_memory_allocated``);
- the kernels on CUDA equal the dense float64 reference;
- the fused final layer with Transformer Engine's core attention (the spec's class subclassed): logits
  bit-identical to the plain TE model, H / top-k equal to the kernels on the q/k TE was handed.
"""
import pytest
import torch

from tests.references import dense_concentration, dense_topk

pytestmark = pytest.mark.gpu


def test_cuda_peak_memory_bound_at_full_size():
    from megatron_credit.models.concentration import attention_concentration, attention_topk

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, 8, 16384, 64, device="cuda", generator=g)
    k = torch.randn(1, 2, 20480, 64, device="cuda", generator=g)
    for fn in (lambda: attention_concentration(q, k), lambda: attention_topk(q, k, 64)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 512 * 2**20
        del out


def test_cuda_kernels_match_dense_float64():
    from megatron_credit.models.concentration import attention_concentration, attention_topk

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 300, 64, generator=g) * 2, torch.randn(2, 2, 333, 64, generator=g)
    h, n = attention_concentration(q.cuda(), k.cuda(), chunk_size=128)
    torch.testing.assert_close(h.cpu().double(), dense_concentration(q, k)[0], rtol=2e-5, atol=1e-7)
    idx, w = attention_topk(q.cuda(), k.cuda(), 8, chunk_size=128)
    (w_ref, idx_ref), _ = dense_topk(q, k, 8)
    assert torch.equal(idx.cpu(), idx_ref)
    torch.testing.assert_close(w.cpu().double(), w_ref, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def world1():
    pytest.importorskip("transformer_engine")
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    distributed.initialize(ParallelConfig(), seed=0)
    yield
    distributed.destroy(process_group=True)


def test_te_final_layer_capture(world1):
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from megatron_credit.models.concentration import attention_concentration, attention_topk
    from tools.gpu_check import _tiny_hf

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cfg = _tiny_hf()
    tc = transformer_config_from_hf(cfg, parallel=ParallelConfig(), use_cpu_initialization=False)
    plain = build_gpt_model(cfg, tc, use_transformer_engine=True).cuda()
    fused = build_gpt_model(cfg, tc, use_transformer_engine=True, capture_final_attention=True).cuda()
    fused.load_state_dict(plain.state_dict())  # same module tree: the capture class subclasses TE's
    core = fused.decoder.layers[-1].self_attention.core_attention
    assert type(core).__name__ == "CapturingTEDotProductAttention"
    seen = {}
    core.register_forward_hook(lambda m, args, out: seen.update(q=args[0].detach(), k=args[1].detach()))
    ids = torch.randint(0, 160, (2, 48), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(48, device="cuda").expand(2, -1)
    with torch.no_grad():
        want = plain(ids, pos, None)
        fused.final_attention_capture.arm(20, 8)
        got = fused(ids, pos, None)
        result = fused.final_attention_capture.result
    assert torch.equal(want, got)
    q, k = (seen[x].permute(1, 2, 0, 3) for x in ("q", "k"))
    h, n = attention_concentration(q[:, :, 20:], k)
    idx, w = attention_topk(q[:, :, 20:], k, 8)
    assert torch.equal(result["H"], h) and torch.equal(result["n"], n)
    assert torch.equal(result["topk_idx"], idx) and torch.equal(result["topk_w"], w)
    torch.testing.assert_close(h.cpu().double(), dense_concentration(q[:, :, 20:].cpu(), k.cpu())[0],
                               rtol=2e-5, atol=1e-7)
