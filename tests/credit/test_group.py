"""Group advantages (GRPO, Dr.GRPO, RLOO) against loop references."""
import pytest
import torch

from megatron_credit.credit.group import (broadcast_to_tokens, dr_grpo_advantages, grpo_advantages,
                                          rloo_advantages)
from tests.references import group_advantages_reference


def make_groups(seed, n_groups=7):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2] + torch.randint(1, 9, (n_groups - 2,), generator=g).tolist()
    ids = torch.cat([torch.full((s,), 100 + 3 * k) for k, s in enumerate(sizes)])
    perm = torch.randperm(len(ids), generator=g)  # members of a group need not be adjacent
    scores = torch.randn(len(ids), generator=g, dtype=torch.float64)
    scores[ids == 100 + 3] = 1.0  # a group with identical scores: std 0
    return scores[perm], ids[perm]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_match_loop(seed):
    scores, ids = make_groups(seed)
    torch.testing.assert_close(grpo_advantages(scores, ids), group_advantages_reference(scores, ids, "grpo"),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grpo_advantages(scores, ids, norm_by_std=False),
                               group_advantages_reference(scores, ids, "dr_grpo"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dr_grpo_advantages(scores, ids), group_advantages_reference(scores, ids, "dr_grpo"),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rloo_advantages(scores, ids), group_advantages_reference(scores, ids, "rloo"),
                               rtol=1e-12, atol=1e-12)


def test_singletons_constant_groups_and_float32():
    scores = torch.tensor([3.0, 1.0, 1.0, 2.0])
    ids = torch.tensor([0, 1, 1, 2])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        out = fn(scores, ids)
        assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(4))
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError):
        grpo_advantages(scores, ids[:3])


def test_broadcast_to_tokens():
    adv = torch.tensor([1.5, -2.0, 0.5])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    expect = torch.tensor([[0.0, 1.5, 1.5, 0.0], [-2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(broadcast_to_tokens(adv, mask), expect)
