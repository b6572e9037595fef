"""Packed (THD) micro-batches through the megatron model on CPU (gloo): the local spec's attention keeps
sequences apart.

- Each sequence of a pack gets the log-probs it gets alone in a batch of one (megatron's own local
  attention), at CP = 1 and CP = 2 (megatron's THD split, RoPE restarted per sequence by megatron).
- Perturbing one sequence of a pack leaves every other sequence's log-probs bit for bit unchanged.
- Gradients of a sum over the pack equal the sum of the sequences' gradients alone.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.sharding import QWEN2

SEED = 1234
LENS = [7, 12, 3, 9]


def _ids():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, QWEN2["vocab_size"], (n + 1,), generator=g) for n in LENS]  # + the label


def _build(parallel, *, packed: bool):
    from megatron_credit.recipe.config import ModelConfig
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    hf = ModelConfig(architecture=QWEN2).hf_config()
    return build_gpt_model(hf, transformer_config_from_hf(hf, parallel=parallel, calculate_per_token_loss=True),
                           packed_sequences=packed)


def _weights_from_reference():
    torch.manual_seed(SEED)
    from megatron_credit.recipe.config import ParallelConfig

    return {k: v.detach().clone() for k, v in _build(ParallelConfig(), packed=False).state_dict().items()
            if v is not None and torch.is_tensor(v)}


def _alone(seqs):
    """Log-probs and parameter gradients of each sequence alone (batch 1, megatron's local attention)."""
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.losses.logprob import logprobs_and_entropy

    distributed.initialize(ParallelConfig(), seed=SEED)
    try:
        model = _build(ParallelConfig(), packed=False)
        model.load_state_dict(_weights_from_reference(), strict=False)
        out = []
        for s in seqs:
            ids, labels = s[None, :-1], s[None, 1:]
            logp, _ = logprobs_and_entropy(model(ids, torch.arange(ids.shape[1])[None], None), labels)
            out.append(logp[0].detach())
            logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out, grads
    finally:
        distributed.destroy()


def _packed(seqs, cp: int):
    """Log-probs of every sequence (whole, gathered over CP) and the gradients of their sum, packed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.batch.packing import PackedIndex
    from megatron_credit.losses.logprob import logprobs_and_entropy

    parallel = ParallelConfig(context_parallel_size=cp)
    distributed.initialize(parallel, seed=SEED)
    try:
        model = _build(parallel, packed=True)
        model.load_state_dict(_weights_from_reference(), strict=False)
        idx = PackedIndex.build([len(s) - 1 for s in seqs], multiple=2 * cp if cp > 1 else 1, cp_size=cp,
                                cp_rank=ps.get_context_parallel_rank())
        rows = torch.zeros(len(seqs), max(len(s) for s in seqs) + 8, dtype=torch.long)
        for k, s in enumerate(seqs):
            rows[k, :len(s)] = s
        ids, labels = idx.pack(rows[:, :-1]), idx.pack(rows[:, 1:])
        cu = idx.cu_seqlens
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=max(idx.padded_lens),
                                 max_seqlen_kv=max(idx.padded_lens))
        logits = model(ids, idx.positions[None], None, packed_seq_params=params)
        logp, _ = logprobs_and_entropy(logits, labels)
        real = torch.tensor([p < n for p, n in zip(idx.positions.tolist(),
                                                   [idx.seq_lens[k] for k in idx.seq_ids.tolist()])])
        torch.where(real[None], logp, 0.0).sum().backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            if cp > 1:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            grads[n] = g
        whole = idx.whole_rows(logp.detach(), cp_group=ps.get_context_parallel_group())
        return [whole[k, :n].clone() for k, n in enumerate(LENS)], grads
    finally:
        distributed.destroy()


pytestmark = pytest.mark.dist

pool1 = module_pool(1)
pool2 = module_pool(2)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_pack_gives_each_sequence_its_own_log_probs_and_gradients(pool1, pool2, cp):
    seqs = _ids()
    ref, ref_grads = pool1.run(_alone, seqs)[0]
    got, grads = (pool1 if cp == 1 else pool2).run(_packed, seqs, cp)[0]
    for k, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"sequence {k}: {m}")
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("cp", [1, 2])
def test_no_token_attends_to_another_sequence(pool1, pool2, cp):
    seqs = _ids()
    other = [s.clone() for s in seqs]
    other[1][:-1] = (other[1][:-1] + 5) % QWEN2["vocab_size"]  # every input token of sequence 1 changes
    pool = pool1 if cp == 1 else pool2
    a, _ = pool.run(_packed, seqs, cp)[0]
    b, _ = pool.run(_packed, other, cp)[0]
    assert not torch.equal(a[1], b[1])
    for k in (0, 2, 3):
        assert torch.equal(a[k], b[k]), f"sequence {k} changed when sequence 1 did"
