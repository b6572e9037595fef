"""The packed index (``megatron_credit/batch/packing.py``) against loop references: where every token goes."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_credit.batch.packing import PackedIndex, rank_indices


def _lens(seed: int, n: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 40) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cp,multiple", [(1, 1), (1, 4), (2, 4), (2, 8), (4, 8)])
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence(seed, cp, multiple):
    lens = _lens(seed)
    covered = []
    for r in range(cp):
        idx = PackedIndex.build(lens, multiple=multiple, cp_size=cp, cp_rank=r)
        start, expect, expect_pos, expect_seq = 0, [], [], []
        for k, n in enumerate(lens):  # loop reference of megatron's THD split
            p = -(-n // multiple) * multiple
            assert idx.padded_lens[k] == p
            c = p // (2 * cp) if cp > 1 else p
            chunks = [r, 2 * cp - 1 - r] if cp > 1 else [0]
            for j in chunks:
                for i in range(j * c, (j + 1) * c):
                    expect.append(start + i)
                    expect_pos.append(i)
                    expect_seq.append(k)
            start += p
        assert idx.local_index.tolist() == expect
        assert idx.positions.tolist() == expect_pos and idx.seq_ids.tolist() == expect_seq
        assert idx.cu_seqlens.tolist()[-1] == idx.total_tokens == start
        assert int(idx.row_slots.sum()) == len(expect)  # one slot per token, no two tokens in one
        covered += expect
    assert sorted(covered) == list(range(sum(PackedIndex.build(lens, multiple=multiple).padded_lens)))
    assert [t.tolist() for t in rank_indices(PackedIndex.build(lens, multiple=multiple).cu_seqlens.tolist(),
                                             cp_size=cp)] == \
        [PackedIndex.build(lens, multiple=multiple, cp_size=cp, cp_rank=r).local_index.tolist() for r in range(cp)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_pack_row_view_and_whole_rows_move_tokens_without_loss(cp):
    lens = _lens(11)
    rows = torch.randn(len(lens), 64, 3, dtype=torch.float64)
    for r in range(cp):
        idx = PackedIndex.build(lens, multiple=2 * cp if cp > 1 else 1, cp_size=cp, cp_rank=r)
        packed = idx.pack(rows)
        assert packed.shape == (1, len(idx.local_index), 3)
        for t, (k, pos) in enumerate(zip(idx.seq_ids.tolist(), idx.positions.tolist())):
            assert torch.equal(packed[0, t], rows[k, pos])
        view = idx.to_rows(packed)
        assert view.shape == (len(lens), idx.row_width, 3)
        assert torch.equal(idx.from_rows(view), packed)
        assert torch.equal(view[~idx.row_slots], torch.zeros_like(view[~idx.row_slots]))
    whole = PackedIndex.build(lens).whole_rows(PackedIndex.build(lens).pack(rows))
    for k, n in enumerate(lens):
        assert torch.equal(whole[k, :n], rows[k, :n])


def test_the_row_view_is_differentiable_both_ways():
    idx = PackedIndex.build([3, 5, 2], multiple=4, cp_size=2, cp_rank=1)
    x = torch.randn(1, len(idx.local_index), dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, idx.row_width, dtype=torch.float64)
    (idx.to_rows(x) * w).sum().backward()
    assert torch.equal(x.grad, idx.from_rows(w))


def test_an_alignment_that_cannot_split_for_cp_is_refused():
    with pytest.raises(ValueError, match="multiple of 2 x CP"):
        PackedIndex.build([5], multiple=2, cp_size=2, cp_rank=0)


def test_host_cu_seqlens_reads_the_attached_host_copy_first():
    from types import SimpleNamespace

    from megatron_credit.batch.packing import host_cu_seqlens

    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert host_cu_seqlens(SimpleNamespace(cu_seqlens_q_padded=cu, cu_seqlens_q=None)) == [0, 4, 10]
    assert host_cu_seqlens(SimpleNamespace(cu_seqlens_q_padded=None, cu_seqlens_q=cu)) == [0, 4, 10]
    attached = SimpleNamespace(cu_seqlens_q_padded=cu, cu_seqlens_q=cu, cu_seqlens_host=(0, 3, 7))
    assert host_cu_seqlens(attached) == [0, 3, 7]  # never reads the (device) tensor when the copy is there
