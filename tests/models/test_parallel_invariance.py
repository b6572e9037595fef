"""Sharding invariance of the megatron actor on CPU (gloo): TP / PP / CP / DP = 2 and TP x PP = 2 x 2.

Every rank first builds the world-size-1 reference (TP = PP = CP = 1; with megatron groups of size 1
it needs no communication), runs it on the whole batch and keeps its weights, logits, log-probs,
entropies and gradients. It then builds the sharded model, loads the *same* weights (sliced with each
parameter's own ``partition_dim`` / ``partition_stride``, layers renumbered per pipeline stage), runs
its share of the batch through megatron's ``forward_backward`` schedule, and gathers everything back
to full shapes. The loss is ``sum_t (w_t logp_t + u_t H_t)`` with random weights, a sum over tokens,
so the DP x CP gradient all-reduce (a sum) must reproduce the full-batch gradient exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.sharding import QWEN2, VOCAB_SHARDED, reference_name, shard, unshard

SEED = 1234
BATCH, SEQ = 4, 16
RTOL, ATOL = 1e-5, 1e-6

QWEN3_TIED = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


# ------------------------------------------------------------------------------- worker-side helpers


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=g)
    labels = torch.randint(0, QWEN2["vocab_size"], (BATCH, SEQ), generator=g)
    w = torch.randn(BATCH, SEQ, generator=g)
    u = torch.randn(BATCH, SEQ, generator=g)
    return ids, labels, w, u


def _build(arch, parallel):
    from megatron_credit.recipe.config import ModelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    hf = ModelConfig(architecture=arch).hf_config()
    # Our loss is a plain sum over tokens and megatron DDP sums over DP x CP: the schedule
    # must not divide it by the token count or the number of microbatches.
    return build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel,
                                                          calculate_per_token_loss=True))


def _reference(arch):
    """World-size-1 outputs and gradients, on every rank (no communication at TP = PP = CP = 1)."""
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.losses.logprob import logprobs_and_entropy

    distributed.initialize(ParallelConfig(), seed=SEED)
    model = _build(arch, ParallelConfig())
    ids, labels, w, u = _batch()
    logits = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None)
    logp, ent = logprobs_and_entropy(logits, labels)
    (w * logp + u * ent).sum().backward()
    out = dict(logits=logits.detach(), logp=logp.detach(), ent=ent.detach(),
               weights={n: p.detach().clone() for n, p in model.named_parameters()},
               grads={n: p.grad.clone() for n, p in model.named_parameters()})
    distributed.destroy()
    return out


def _run_sharded(arch, tp, pp, cp, ref):
    """Outputs and full-shape gradients of the sharded model; logits etc. on the last stage only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_credit import distributed
    from megatron_credit.distributed.grads import finalize, grad_of, wrap_ddp
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.losses.logprob import logprobs_and_entropy
    from megatron_credit.models.cpu_attention import load_balanced_positions

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp)
    distributed.initialize(parallel, seed=SEED)
    model = _build(arch, parallel)
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    # Tied embeddings, PP > 1: setup_embeddings_and_output_layer zero-filled the last stage's copy
    # and all-reduced the first stage's weights into it over the embedding group (shim 4 on CPU).
    tied_copy_equal = all(torch.equal(p, ref["weights"]["embedding.word_embeddings.weight"])
                          for n, p in model.named_parameters() if n == "output_layer.weight"
                          and model.share_embeddings_and_output_weights and tp == 1)
    same_init = all(torch.equal(shard(ref["weights"][reference_name(model, n)], p, tp_rank, tp), p)
                    for n, p in model.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(shard(ref["weights"][reference_name(model, n)], p, tp_rank, tp))

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = torch.arange(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    pos = load_balanced_positions(SEQ // cp, cp_rank=ps.get_context_parallel_rank(), cp_size=cp)
    ids, labels, w, u = (t[rows][:, pos] for t in _batch())
    kept = {}

    def loss_func(logits):
        logp, ent = logprobs_and_entropy(logits, labels, tp_group=tp_group)
        kept.update(logits=logits.detach(), logp=logp.detach(), ent=ent.detach())
        loss = (w * logp + u * ent).sum()
        return loss, torch.tensor(labels.numel(), dtype=torch.int), {"loss": loss.detach()}

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        return model_chunk(batch, pos.expand(len(rows), -1), None), loss_func

    ddp = wrap_ddp(model)  # the trainer's gradient path: megatron DDP + finalize_model_grads
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([ids]), model=[ddp], num_microbatches=1,
        # The global length: megatron's get_tensor_shapes divides by the CP size itself.
        seq_length=SEQ, micro_batch_size=len(rows), forward_only=False)
    finalize(ddp)
    grads = [(reference_name(model, n), unshard(grad_of(p), p, tp_group))
             for n, p in model.named_parameters()]
    out = dict(grads=grads, same_init=same_init, tied_copy_equal=tied_copy_equal, rows=rows, pos=pos)
    if kept:
        out.update(logp=kept["logp"], ent=kept["ent"],
                   logits=unshard(kept["logits"], VOCAB_SHARDED, tp_group))
    distributed.destroy()
    dist.barrier()
    return out


def _case(arch, tp, pp, cp):
    """Run on every rank; returns (reference, per-rank sharded results) to the test process."""
    torch.set_num_threads(1)
    ref = _reference(arch)
    mine = _run_sharded(arch, tp, pp, cp, ref)
    del ref["weights"]
    return ref, mine


def _check(results, *, tp):
    ref = results[0][0]
    covered_grads, covered_tokens = {}, torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for _, mine in results:
        for name, g in mine["grads"]:
            # atol scales with the tensor: the tied embedding's gradient (input + output use, ~6 at
            # most) differs by ~3e-6 (float32 summation order) where single entries are near 0.
            r = ref["grads"][name]
            torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL * max(1.0, float(r.abs().max())),
                                       msg=name)
            covered_grads[name] = True
        if "logp" in mine:
            sel = (mine["rows"][:, None], mine["pos"][None, :])
            for key in ("logits", "logp", "ent"):
                torch.testing.assert_close(mine[key], ref[key][sel], rtol=RTOL, atol=ATOL, msg=key)
            covered_tokens[sel] = True
    assert set(covered_grads) == set(ref["grads"]), "some parameters live on no rank"
    assert covered_tokens.all(), "some tokens were computed on no rank"
    return [mine["same_init"] for _, mine in results]


# ------------------------------------------------------------------------------------------- tests


pool2 = module_pool(2)


pool4 = module_pool(4)


@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 1)],
                         ids=["tp2", "pp2", "cp2", "dp2"])
@pytest.mark.dist
def test_two_ranks_match_world_size_one(pool2, tp, pp, cp):
    same_init = _check(pool2.run(_case, QWEN2, tp, pp, cp), tp=tp)
    if pp == 1:
        # use_cpu_initialization: the TP shards built from the seed are slices of the TP=1 weights.
        assert all(same_init)


@pytest.mark.dist
def test_tp2_tied_qwen3_with_qk_norm(pool2):
    assert all(_check(pool2.run(_case, QWEN3_TIED, 2, 1, 1), tp=2))


@pytest.mark.dist
def test_pp2_tied_embeddings_match_world_size_one(pool2):
    # Both stages hold the shared embedding (first: input, last: output copy); after
    # finalize_model_grads' embedding-group sum each copy's gradient equals the reference's.
    results = pool2.run(_case, QWEN3_TIED, 1, 2, 1)
    _check(results, tp=1)
    assert all(mine["tied_copy_equal"] for _, mine in results)
    assert sum(name == "embedding.word_embeddings.weight" for _, mine in results
               for name, _ in mine["grads"]) == 2


@pytest.mark.dist
def test_pp2_cp2_match_world_size_one(pool4):
    _check(pool4.run(_case, QWEN2, 1, 2, 2), tp=1)


@pytest.mark.dist
def test_tp2_pp2_match_world_size_one(pool4):
    _check(pool4.run(_case, QWEN2, 2, 2, 1), tp=2)


@pytest.mark.dist
def test_tp2_cp2_match_world_size_one(pool4):
    assert all(_check(pool4.run(_case, QWEN2, 2, 1, 2), tp=2))


def test_cp_positions_match_the_data_split():
    from megatron_credit.batch.context_parallel import split_for_cp
    from megatron_credit.models.cpu_attention import load_balanced_positions

    pos = torch.arange(24).view(1, 24)
    for rank in range(3):
        expected = load_balanced_positions(8, cp_rank=rank, cp_size=3)
        assert torch.equal(split_for_cp(pos, cp_size=3, cp_rank=rank)[0], expected)
