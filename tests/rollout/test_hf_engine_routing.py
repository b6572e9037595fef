"""The HF engine records a mixture of experts' routing (``RoutingRecorder``): each sample's
``routed_experts`` are the experts its tokens go to when the whole sequence is run through the model
teacher-forced, whatever the batch (left padding, n samples per prompt sharing a pre-fill, finished rows
dropped from the batch as decoding goes on); the last token, which no forward ran, is -1. A dense model's
samples carry none. And the rollout's padded form keeps them ragged (each sample's own tensor), -1 on
padding once cut."""
from __future__ import annotations

import pytest
import torch

from megatron_credit.rollout.hf_engine import HFRolloutEngine
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, RolloutSample, SamplingParams

TINY_MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=10000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine():
    return HFRolloutEngine(hf_config=TINY_MOE, init_seed=3)


def _teacher_forced(engine, ids: list[int]) -> torch.Tensor:
    """Each position's experts ``[len(ids), layers, top_k]`` from one forward of the whole sequence."""
    with torch.inference_mode():
        engine.model(input_ids=torch.tensor([ids]), use_cache=False)
    return engine._routing.take(1, len(ids))[0]  # the engine's own recorder


def test_samples_carry_the_experts_of_a_teacher_forced_forward(engine):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 9, 5)]
    # a stop token ends some rows early: they leave the batch (compaction) while others decode on
    batch = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=10, seed=5, stop_token_ids=(7, 11, 19)))
    stopped = 0
    for s in batch.samples:
        ids = s.prompt_ids + s.response_ids
        r = s.routed_experts
        assert r.shape == (len(ids), 2, 2) and r.dtype == torch.int16
        want = _teacher_forced(engine, ids)
        # the set of experts per (token, layer): top-k order is not part of the routing
        assert torch.equal(r[:-1].sort(-1).values, want[:-1].sort(-1).values)
        assert (r[-1] == -1).all()
        stopped += s.status == FinishStatus.STOPPED
    assert 0 < stopped < len(batch.samples)


def test_a_dense_model_records_nothing():
    dense = HFRolloutEngine(hf_config=dict(model_type="qwen2", vocab_size=32, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           max_position_embeddings=32))
    s = dense.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=1)).samples[0]
    assert s.routed_experts is None


def _sample(prompt, response, routed):
    return RolloutSample(prompt_ids=prompt, response_ids=response, logprobs=torch.zeros(len(response)),
                         status=FinishStatus.STOPPED, group_id=0, sample_index=0, logprobs_mode="raw",
                         routed_experts=routed)


def test_the_padded_rollout_keeps_the_routing_ragged_with_minus_one_on_padding_and_where_none_was_reported():
    a = torch.arange(5 * 2 * 2, dtype=torch.int16).view(5, 2, 2)
    padded = RolloutBatch(samples=[_sample([1, 2], [3, 4, 5], a), _sample([1], [2], None)]).to_padded(pad_token_id=0)
    ragged = padded.routed_experts
    assert ragged.rows[0] is a and ragged.rows[1] is None  # the sample's own tensor, not a padded copy
    r = ragged.padded(padded.input_ids.shape[1])  # what a micro-batch's cut of the rows gives
    assert r.shape == (2, 5, 2, 2)
    assert torch.equal(r[0], a) and (r[1] == -1).all()
    assert RolloutBatch(samples=[_sample([1], [2], None)]).to_padded(pad_token_id=0).routed_experts is None


def test_routing_of_the_wrong_length_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="routed_experts must have shape \\[3, layers, top_k\\]"):
        _sample([1, 2], [3], torch.zeros(2, 2, 2, dtype=torch.int16))
