"""Sample groups as bytes of tensors (``rollout/wire.py``): every field survives, nothing is pickled, a
message's size is its payload plus a small header, and a damaged message is refused in one line."""
from __future__ import annotations

import pytest
import torch

from megatron_credit.rollout.types import FinishStatus, RolloutSample, SampleTimings
from megatron_credit.rollout.wire import decode, encode, payload_bytes


def _items():
    a = RolloutSample(prompt_ids=[1, 2, 3], response_ids=[70000, 5], logprobs=torch.tensor([-0.25, -1.5]),
                      status=FinishStatus.TRUNCATED, group_id=4, sample_index=1, logprobs_mode="processed",
                      timings=SampleTimings(first_token_s=0.125, finish_s=2.5),
                      routed_experts=torch.tensor([[[0, 3]], [[1, 2]], [[3, 1]], [[2, 0]], [[-1, -1]]], dtype=torch.int16))
    failed = RolloutSample(prompt_ids=[9] * 4, response_ids=[], logprobs=torch.zeros(0), status=FinishStatus.FAILED,
                           group_id=4, sample_index=0, logprobs_mode="processed", error="prompt of 4 tokens: no room ✗")
    return [(7, ([failed, a], torch.tensor([-1.0, 0.5]), torch.tensor([False, True]))),
            (2, ([], torch.zeros(0), torch.zeros(0, dtype=torch.bool)))]


def test_every_field_survives_the_round_trip():
    items = _items()
    got = decode(encode(items))
    assert [k for k, _ in got] == [7, 2]
    (samples, rewards, correct), (empty, r2, c2) = got[0][1], got[1][1]
    assert rewards.tolist() == [-1.0, 0.5] and correct.tolist() == [False, True] and empty == [] and len(r2) == 0
    for want, s in zip(items[0][1][0], samples):
        assert (s.prompt_ids, s.response_ids, s.status, s.group_id, s.sample_index, s.logprobs_mode, s.error,
                s.timings) == (want.prompt_ids, want.response_ids, want.status, want.group_id, want.sample_index,
                               want.logprobs_mode, want.error, want.timings)
        assert torch.equal(s.logprobs, want.logprobs) and s.logprobs.dtype == torch.float32
        assert (s.routed_experts is None) == (want.routed_experts is None)
        if want.routed_experts is not None:
            assert torch.equal(s.routed_experts, want.routed_experts) and s.routed_experts.dtype == torch.int16


def test_a_message_is_its_payload_and_a_header():
    items = _items()
    buf = encode(items)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    # 8 header bytes, 4 per word (1 + 3 per item + 9 per sample), 16 per sample's timings, the error text
    error = len(items[0][1][0][0].error.encode())
    assert buf.numel() == payload_bytes(items) + 8 + 4 * (1 + 3 * 2 + 9 * 2) + 16 * 2 + error
    assert payload_bytes(items) == 5 * 2 + 4 * (4 + 0) + 4 * (3 + 2 * 2) + 2 * 5 * 2


def test_a_damaged_message_is_refused_in_one_line():
    buf = encode(_items())
    with pytest.raises(ValueError, match=r"^sample message truncated: \d+ bytes, needs at least \d+$"):
        decode(buf[:-3])
    with pytest.raises(ValueError, match=r"^sample message has 2 bytes after its last sample$"):
        decode(torch.cat([buf, torch.zeros(2, dtype=torch.uint8)]))
