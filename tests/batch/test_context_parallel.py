"""CP batch split/gather: megatron's load-balanced chunk order, round trips, errors, and a gloo gather test."""
import pytest
import torch

from megatron_credit.batch.context_parallel import (
    check_sequence_length, gather_from_cp, merge_cp_shards, pad_for_parallel, required_multiple,
    shift_labels, split_for_cp,
)
from tests.support.distributed_harness import block_subgroup, module_pool


def _expected_positions(seq, cp, rank):
    """Loop reference of the chunk order: chunk c of 2*cp covers [c*k, (c+1)*k); rank r keeps r, 2cp-1-r."""
    k = seq // (2 * cp)
    return [c * k + i for c in (rank, 2 * cp - 1 - rank) for i in range(k)]


def test_shift_labels():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert shift_labels(ids, pad_id=-1).tolist() == [[2, 3, 4, -1], [6, 7, 8, -1]]
    with pytest.raises(ValueError, match="input_ids"):
        shift_labels(ids[0], pad_id=0)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [0, 1, 2, -1])
def test_split_chunk_order_and_round_trip(cp, seq_dim):
    shape = [3, 4, 5]
    shape[seq_dim] = 16
    x = torch.randn(*shape, dtype=torch.float64)
    shards = [split_for_cp(x, cp_size=cp, cp_rank=r, seq_dim=seq_dim) for r in range(cp)]
    for r, s in enumerate(shards):
        want = x.index_select(seq_dim, torch.tensor(_expected_positions(16, cp, r)))
        assert torch.equal(s, want)
    assert torch.equal(merge_cp_shards(shards, seq_dim=seq_dim), x)


def test_labels_shifted_before_split_cross_chunk_boundaries():
    ids = torch.arange(8).view(1, 8)
    labels = shift_labels(ids, pad_id=-1)
    # rank 0 holds positions 0,1,6,7: the label of position 1 (token 2) lives on rank 1.
    assert split_for_cp(labels, cp_size=2, cp_rank=0).tolist() == [[1, 2, 7, -1]]
    assert split_for_cp(labels, cp_size=2, cp_rank=1).tolist() == [[3, 4, 5, 6]]


def test_split_gradient_flows():
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, dtype=torch.float64)
    (split_for_cp(x, cp_size=2, cp_rank=1) * w).sum().backward()
    want = torch.zeros(2, 8, dtype=torch.float64)
    want[:, 2:6] = w
    assert torch.equal(x.grad, want)


def test_errors_name_the_length():
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 4"):
        split_for_cp(torch.zeros(1, 6), cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="sequence length 2 is shorter than 8"):
        split_for_cp(torch.zeros(1, 2), cp_size=4, cp_rank=0)
    with pytest.raises(ValueError, match="cp_rank"):
        split_for_cp(torch.zeros(1, 8), cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="sequence length 20 is not divisible by 16"):
        check_sequence_length(20, multiple=required_multiple(2, 4, True))
    check_sequence_length(16, multiple=16)
    with pytest.raises(ValueError, match="equal shapes"):
        merge_cp_shards([torch.zeros(1, 4), torch.zeros(1, 6)])


def test_required_multiple_and_padding():
    assert required_multiple(1, 1, False) == 2
    assert required_multiple(2, 4, True) == 16
    assert required_multiple(2, 4, False) == 4
    assert required_multiple(4, 2, True) == 16
    with pytest.raises(ValueError, match="cp_size"):
        required_multiple(0, 1, False)
    x = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    padded = pad_for_parallel(x, multiple=4, value=0)
    assert padded.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 0, 0, 0]]
    assert pad_for_parallel(x[:, :1], multiple=8, value=-1).tolist() == [[1] + [-1] * 7, [6] + [-1] * 7]
    assert pad_for_parallel(padded, multiple=4, value=0) is padded
    assert pad_for_parallel(x.t(), multiple=3, value=0, seq_dim=0).shape == (6, 2)
    # A padded sequence always splits.
    split_for_cp(pad_for_parallel(x, multiple=required_multiple(2, 1, False), value=0), cp_size=2, cp_rank=1)


# ------------------------------------------------------------------------------------- gloo
WORLD = 4


pool = module_pool(WORLD)


_cp_group = block_subgroup


def _gather_worker(cp, x, w, seq_dim):
    group, r = _cp_group(cp)
    leaf = x.clone().requires_grad_()
    local = split_for_cp(leaf, cp_size=cp, cp_rank=r, seq_dim=seq_dim)
    full = gather_from_cp(local * 1.0, cp_group=group, seq_dim=seq_dim)
    (full * w).sum().backward()  # the same loss on every CP rank (replicated computation)
    return full.detach(), leaf.grad


def _megatron_chunk_order_worker(cp, batch):
    # Through our version-neutral wrapper: megatron-core 0.18+ added a required `is_hybrid_cp`.
    from megatron_credit.distributed import get_batch_on_this_cp_rank

    group, r = _cp_group(cp)
    ours = {k: split_for_cp(v, cp_size=cp, cp_rank=r) for k, v in batch.items()}
    theirs = get_batch_on_this_cp_rank(dict(batch), cp_group=group)
    return all(torch.equal(ours[k], theirs[k]) for k in batch)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seq_dim", [1, 0])
@pytest.mark.dist
def test_gather_inverts_split_with_gradient(pool, cp, seq_dim):
    gen = torch.Generator().manual_seed(cp)
    shape = (3, 16) if seq_dim == 1 else (16, 3)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    w = torch.randn(*shape, generator=gen, dtype=torch.float64)
    out = pool.run(_gather_worker, cp, x, w, seq_dim)
    for start in range(0, WORLD, cp):
        group_grad = torch.zeros_like(x)
        for rank in range(start, start + cp):
            full, grad = out[rank]
            assert torch.equal(full, x)
            # This rank's gradient is w on exactly its own positions, zero elsewhere.
            positions = torch.tensor(_expected_positions(16, cp, rank - start))
            mask = torch.zeros(16, dtype=torch.bool)
            mask[positions] = True
            mask = mask.view(1, 16) if seq_dim == 1 else mask.view(16, 1)
            assert torch.equal(grad, torch.where(mask, w, torch.zeros_like(w)))
            group_grad += grad
        assert torch.equal(group_grad, w)  # the CP group together holds the full gradient once


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.dist
def test_split_equals_megatron_get_batch_on_this_cp_rank(pool, cp):
    gen = torch.Generator().manual_seed(40 + cp)
    batch = {"tokens": torch.randint(0, 100, (2, 24), generator=gen),
             "loss_mask": torch.rand(2, 24, generator=gen)}
    assert pool.run(_megatron_chunk_order_worker, cp, batch) == [True] * WORLD
