"""LoRA adapters on megatron's linears (``megatron_credit/models/lora.py``).

- an adapted linear is ``x W^T + (x A^T B^T) alpha / rank``: against the float64 loop reference, for a
  column-parallel (``linear_qkv``) and a row-parallel (``linear_fc2``) linear;
- a new adapter changes nothing (``B = 0``), and with its adapters off a trained model is its base again;
- only the adapters train: the base is frozen, megatron's DDP holds buffers for the adapters alone;
- the merged weight ``W + B A alpha / rank`` gives the adapted model's logits in a model without adapters
  (what the rollout engine receives);
- the same logits, log-probs and adapter gradients at TP = 2 (with and without sequence parallelism),
  PP = 2 and CP = 2 as at world size 1 (gloo), and every layout draws the same initial adapters.
"""
from __future__ import annotations

import pytest
import torch

from megatron_credit.models.lora import adapters, adapters_off, attach, is_adapter_name
from tests.references import lora_linear_reference
from tests.support.distributed_harness import module_pool
from tests.support.sharding import QWEN2, reference_name, shard, unshard

RANK, ALPHA, SEED = 4, 8.0, 7
BATCH, SEQ = 2, 8


def _model(parallel, *, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
    from megatron.core import parallel_state as ps

    from megatron_credit.models import build_gpt_model, transformer_config_from_hf
    from megatron_credit.recipe.config import ModelConfig

    hf = ModelConfig(architecture=QWEN2).hf_config()
    model = build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel, calculate_per_token_loss=True))
    offset = ps.get_pipeline_model_parallel_rank() * QWEN2["num_hidden_layers"] // ps.get_pipeline_model_parallel_world_size()
    attach(model, rank=RANK, alpha=ALPHA, dropout=0.0, targets=targets, seed=SEED, layer_offset=offset,
           tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
           tp_group=ps.get_tensor_model_parallel_group(), sequence_parallel=parallel.sequence_parallel)
    return model


def _random_b(model):
    """Every adapter's B drawn from a generator of its global name (B = 0 would test nothing)."""
    import zlib

    with torch.no_grad():
        for name, adapter in adapters(model):
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def world1():
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    distributed.initialize(ParallelConfig(), seed=0)
    yield
    distributed.destroy(process_group=True)


@pytest.mark.parametrize("linear", ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc2"])
def test_an_adapted_linear_is_the_loop_reference(world1, linear):
    from megatron_credit.recipe.config import ParallelConfig

    model = _model(ParallelConfig())
    _random_b(model)
    module = model.get_submodule(linear)
    adapter = module.lora
    x = torch.randn(3, 2, module.weight.shape[1], generator=torch.Generator().manual_seed(1))
    out, bias = module(x)
    bias_in_out = None if module.skip_bias_add else getattr(module, "bias", None)
    want = lora_linear_reference(x, module.weight.detach(), adapter.a.detach(), adapter.b.detach(), ALPHA / RANK,
                                 bias=None if bias_in_out is None else bias_in_out.detach())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert bias is None or module.skip_bias_add  # a skipped bias comes back apart, as megatron's does


def test_a_new_adapter_changes_nothing_and_adapters_off_is_the_base(world1):
    from megatron_credit.recipe.config import ParallelConfig

    model = _model(ParallelConfig())
    ids = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        start = model(ids, pos, None)
        with adapters_off(model):
            base = model(ids, pos, None)
        assert torch.equal(start, base)  # B = 0: the adapted model starts as its base
        _random_b(model)
        trained = model(ids, pos, None)
        with adapters_off(model):
            off = model(ids, pos, None)
        again = model(ids, pos, None)
    assert not torch.allclose(trained, start, atol=1e-3)
    assert torch.equal(off, base) and torch.equal(again, trained)  # off inside the block only


def test_only_the_adapters_train(world1):
    from megatron_credit.distributed.grads import wrap_ddp
    from megatron_credit.recipe.config import ParallelConfig

    model = _model(ParallelConfig())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(n) for n in trainable)
    # 4 linears x 2 layers, A [r, in] and B [out, r] each
    h, ffn, qkv = QWEN2["hidden_size"], QWEN2["intermediate_size"], 64 + 2 * 2 * 16
    per_layer = RANK * (h + qkv) + RANK * (h + h) + RANK * (h + 2 * ffn) + RANK * (ffn + h)
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == 2 * per_layer
    ddp = wrap_ddp(model)
    buffered = {id(p) for buf in ddp.buffers for p in buf.params}
    assert buffered == {id(p) for n, p in model.named_parameters() if n in trainable}


def test_every_frozen_linear_gets_a_gradient_matmul_can_fold_into_one_product(world1, monkeypatch):
    """megatron's ``LinearWithFrozenWeight.backward`` multiplies the gradient as it arrives; one sequence in a
    micro-batch (b = 1) reaches the projections with the stride of its ``[b, s]`` dim order, and ``matmul``
    then takes a batched product with the weight copied per position (6x a LoRA update on CPU). The hook of
    ``models/lora.py`` hands each frozen linear a row-major gradient: same values, strides recomputed."""
    from megatron.core.tensor_parallel import layers

    from megatron_credit.recipe.config import ParallelConfig

    seen = []
    backward = layers.LinearWithFrozenWeight.backward

    def recording(ctx, grad_output):
        seen.append((tuple(grad_output.shape), grad_output.stride()))
        return backward(ctx, grad_output)

    monkeypatch.setattr(layers.LinearWithFrozenWeight, "backward", staticmethod(recording))
    model = _model(ParallelConfig())
    _random_b(model)
    ids = torch.randint(0, QWEN2["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))
    logits = model(ids, torch.arange(SEQ)[None], None)
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()

    def row_major(shape, stride):
        return all(stride[i] == stride[i + 1] * shape[i + 1] for i in range(len(shape) - 1))

    assert len(seen) == 2 * 4  # the four projections of 2 layers
    assert all(row_major(shape, stride) for shape, stride in seen), seen
    assert all(p.grad is not None for _, a in adapters(model) for p in a.parameters())


def test_the_merged_weights_give_the_adapted_models_logits(world1):
    from megatron_credit.models.lora import MergedState
    from megatron_credit.recipe.config import ParallelConfig

    model = _model(ParallelConfig())
    _random_b(model)
    plain = _model(ParallelConfig(), targets=("linear_qkv",))
    merged = MergedState(model)
    assert not any(is_adapter_name(k) for k in merged) and len(merged) == len(
        [k for k in model.state_dict() if not is_adapter_name(k)])
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    torch.testing.assert_close(merged["decoder.layers.0.self_attention.linear_qkv.weight"],
                               qkv.weight + qkv.lora.b @ qkv.lora.a * (ALPHA / RANK))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if not is_adapter_name(name):
                p.copy_(merged[name])
    ids = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad(), adapters_off(plain):
        torch.testing.assert_close(plain(ids, pos, None), model(ids, pos, None), rtol=1e-5, atol=1e-5)


def test_unknown_targets_are_refused_in_one_line(world1):
    from megatron_credit.recipe.config import ParallelConfig

    with pytest.raises(ValueError, match=r"model.lora.targets: unknown \['q_proj'\]"):
        _model(ParallelConfig(), targets=("q_proj",))


# ------------------------------------------------------------------------- sharding invariance (gloo)


def _grads_and_logp(parallel, ref_weights=None):
    """This rank's model (its adapters' B random, or every weight from ``ref_weights``): log-probs of a fixed
    batch and the adapters' full gradients after megatron's schedule and ``finalize_model_grads``."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_credit.distributed.grads import finalize, grad_of, wrap_ddp
    from megatron_credit.losses.logprob import logprobs_and_entropy
    from megatron_credit.models.cpu_attention import load_balanced_positions

    model = _model(parallel)
    tp, tp_rank, tp_group = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                             ps.get_tensor_model_parallel_group())
    same_init = True
    if ref_weights is None:
        _random_b(model)
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                full = ref_weights[reference_name(model, n)]
                if n.endswith("lora.a"):
                    same_init &= torch.equal(shard(full, p, tp_rank, tp), p)
                p.copy_(shard(full, p, tp_rank, tp))
    cp = ps.get_context_parallel_world_size()
    pos = load_balanced_positions(SEQ // cp, cp_rank=ps.get_context_parallel_rank(), cp_size=cp)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=g)
    labels = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=g)
    w = torch.randn(BATCH, SEQ, generator=g)
    ids, labels, w = ids[:, pos], labels[:, pos], w[:, pos]
    kept = {}

    def loss_func(logits):
        logp, _ = logprobs_and_entropy(logits, labels, tp_group=tp_group)
        kept["logp"] = logp.detach()
        loss = (w * logp).sum()
        return loss, torch.tensor(labels.numel(), dtype=torch.int), {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        return chunk(next(data_iterator), pos.expand(BATCH, -1), None), loss_func

    if ref_weights is None:  # world size 1 inside a 2-rank world: megatron's DDP would sum over its DP of 2
        loss_func(model(ids, pos.expand(BATCH, -1), None))[0].backward()
    else:
        ddp = wrap_ddp(model)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=[ddp],
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
        finalize(ddp)
    grads = {reference_name(model, n): unshard(grad_of(p), p, tp_group) for n, p in model.named_parameters()
             if p.requires_grad}
    frozen_untouched = all(getattr(p, "main_grad", None) is None and p.grad is None
                           for n, p in model.named_parameters() if not is_adapter_name(n))
    weights = {reference_name(model, n): p.detach().clone() for n, p in model.named_parameters()}
    return dict(grads=grads, logp=kept.get("logp"), pos=pos, weights=weights, same_init=same_init,
                frozen_untouched=frozen_untouched)


def _case(tp, pp, cp, sp):
    import torch.distributed as dist

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig

    torch.set_num_threads(1)
    distributed.initialize(ParallelConfig(), seed=SEED)
    ref = _grads_and_logp(ParallelConfig())
    distributed.destroy()
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp, sequence_parallel=sp)
    distributed.initialize(parallel, seed=SEED)
    mine = _grads_and_logp(parallel, ref["weights"])
    distributed.destroy()
    dist.barrier()
    del ref["weights"], mine["weights"]
    return ref, mine


pool2 = module_pool(2)


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp,cp,sp", [(2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False)],
                         ids=["tp2", "tp2-sp", "pp2", "cp2"])
def test_adapters_give_the_same_numbers_in_every_layout(pool2, tp, pp, cp, sp):
    results = pool2.run(_case, tp, pp, cp, sp)
    ref = results[0][0]
    covered = set()
    for _, mine in results:
        assert mine["same_init"] and mine["frozen_untouched"]
        for name, g in mine["grads"].items():
            assert is_adapter_name(name)
            r = ref["grads"][name]  # float32 sums in another order: the tolerance scales with the tensor
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * max(1.0, float(r.abs().max())),
                                       msg=lambda m, name=name: f"{name}: {m}")
            covered.add(name)
        if mine["logp"] is not None:
            torch.testing.assert_close(mine["logp"], ref["logp"][:, mine["pos"]], rtol=1e-5, atol=1e-6)
    assert covered == set(ref["grads"]) and len(covered) == 2 * 4 * 2
    assert any(float(g.abs().max()) > 0 for g in ref["grads"].values())
