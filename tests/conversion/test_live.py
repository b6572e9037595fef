"""The weight-sync generator: HF-named tensors gathered from a TP- or PP-sharded megatron model, in
size-bounded buckets, equal bit for bit to the HF checkpoint, on every rank (gloo, 2 ranks)."""
from __future__ import annotations

import pytest
import torch

from tests.support.distributed_harness import module_pool
from tests.support.live_export import BUCKET, _export_real_model, _hf_state


def _local_state(family: str, tied: bool, *, tp: int, pp: int, rank: int, vocab_pad: int):
    """A rank's state dict, built independently of the library's loaders: slices written out here."""
    from megatron_credit.conversion import FAMILIES, iter_megatron_from_hf

    cfg, hf = _hf_state(family, tied)
    full = dict(iter_megatron_from_hf(hf.__getitem__, FAMILIES.get(family), cfg))
    tp_rank, pp_rank = (rank, 0) if tp > 1 else (0, rank)
    per_stage = cfg.num_hidden_layers // pp
    local = {}
    for name, t in full.items():
        if "word_embeddings" in name or "output_layer" in name:
            t = torch.cat([t, torch.full((vocab_pad, t.shape[1]), 7.0)])  # padding rows must be dropped
        if name.startswith("decoder.layers."):
            i = int(name.split(".")[2])
            if i // per_stage != pp_rank:
                continue
            name = name.replace(f"layers.{i}.", f"layers.{i - pp_rank * per_stage}.", 1)
        elif name.startswith("embedding") and pp_rank != 0:
            continue
        elif (name.startswith("output_layer") or name.startswith("decoder.final")) and pp_rank != pp - 1:
            continue
        if tp > 1:
            if "linear_fc1" in name:  # rank r: [gate_r; up_r]
                gate, up = t.chunk(2)
                t = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
            elif any(s in name for s in ("linear_qkv", "word_embeddings", "output_layer")):
                t = t.chunk(tp)[tp_rank]
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                t = t.chunk(tp, dim=1)[tp_rank]
        local[name] = t.clone()
    if tied and pp_rank == pp - 1 and pp > 1:  # megatron keeps a copy of a tied head on the last stage
        emb = torch.cat([hf["model.embed_tokens.weight"], torch.full((vocab_pad, cfg.hidden_size), 7.0)])
        local["output_layer.weight"] = emb.chunk(tp)[tp_rank].clone() if tp > 1 else emb
    local["decoder.layers.0.self_attention.core_attention._extra_state"] = None  # TE-style entry: skipped
    return cfg, local, pp_rank * per_stage


def _export(family: str, tied: bool, tp: int, pp: int):
    import torch.distributed as dist

    from megatron_credit.conversion import FAMILIES, iter_hf_weight_buckets

    rank = dist.get_rank()
    cfg, local, offset = _local_state(family, tied, tp=tp, pp=pp, rank=rank, vocab_pad=2)
    group = dist.new_group([0, 1])
    buckets = list(iter_hf_weight_buckets(local, FAMILIES.get(family), cfg, tp_group=group if tp > 1 else None,
                                          pp_group=group if pp > 1 else None, layer_offset=offset,
                                          bucket_bytes=BUCKET))
    return [[(n, t.clone()) for n, t in b] for b in buckets]


pool = module_pool(2)


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen3", True), ("llama", True)])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.dist
def test_buckets_equal_hf_state_on_every_rank(pool, family, tied, tp, pp):
    _, hf = _hf_state(family, tied)
    per_rank = pool.run(_export, family, tied, tp, pp)
    for buckets in per_rank:
        names = [n for b in buckets for n, _ in b]
        assert sorted(names) == sorted(hf) and len(names) == len(set(names))
        from megatron_credit.rollout.weight_sync import sync_group

        groups = [[sync_group(n) for n, _ in b] for b in buckets]
        for b, g in zip(buckets, groups):  # over the size only by one whole group (a decoder layer)
            sizes = [t.numel() * t.element_size() for _, t in b]
            assert len(set(g)) == 1 or sum(sizes) <= BUCKET
        assert all(not set(g) & set(h) for g, h in zip(groups, groups[1:]))  # no group split
        assert len(buckets) > 3
        for b in buckets:
            for n, t in b:
                assert t.dtype == hf[n].dtype and torch.equal(t, hf[n]), n
    assert [[n for n, _ in b] for b in per_rank[0]] == [[n for n, _ in b] for b in per_rank[1]]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
@pytest.mark.dist
def test_real_model_export_round_trips(pool, tp, pp):
    for family in ("qwen3", "llama"):  # llama tied: the export has no lm_head, whichever stage holds it
        _, hf = _hf_state(family, tied=(family == "llama"))
        results = pool.run(_export_real_model, family, tp, pp)
        for out, _ in results:
            assert sorted(out) == sorted(hf)
            for k in hf:
                assert torch.equal(out[k], hf[k]), (family, k)
        heads = [head for _, head in results if head is not None]
        # Only a tied model split over PP keeps a head copy, on the last stage: the HF embedding.
        assert len(heads) == (1 if family == "llama" and pp == 2 else 0), (family, len(heads))
        for head in heads:
            assert torch.equal(head, hf["model.embed_tokens.weight"]), family


def test_bucket_size_must_be_positive():
    from megatron_credit.conversion import FAMILIES, iter_hf_weight_buckets

    cfg, _ = _hf_state("qwen2", False)
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_hf_weight_buckets({}, FAMILIES.get("qwen2"), cfg, bucket_bytes=0))
