"""The live actor -> rollout engine path on one process: megatron GPTModel -> HF-named buckets
(``conversion.iter_hf_weight_buckets``) -> "hf" engine, with no disk round trip. After the sync the
engine's log-probs equal the actor's own, so the rollout/trainer mismatch is float noise."""
from __future__ import annotations

import pytest
import torch

from megatron_credit.recipe.config import ModelConfig, ParallelConfig
from megatron_credit.rollout import HFRolloutEngine, SamplingParams, logprob_mismatch

ARCH = dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
            rope_theta=1e4, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])


@pytest.fixture(scope="module")
def actor():
    from megatron_credit import distributed
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    distributed.initialize(ParallelConfig(), seed=0)
    hf_config = ModelConfig(architecture=ARCH).hf_config()
    torch.manual_seed(0)
    model = build_gpt_model(hf_config, transformer_config_from_hf(hf_config, parallel=ParallelConfig())).eval()
    with torch.no_grad():  # larger weights than megatron's init, so the policy is far from uniform
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    yield hf_config, model
    distributed.destroy(process_group=True)


def _actor_logprobs(model, padded) -> torch.Tensor:
    """[B, T] actor log-prob of each token given its prefix (0 at t = 0), as the trainer computes it."""
    ids = padded.input_ids
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        logits = model(ids, pos, None).double()  # causal: right padding cannot affect real tokens
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0))


def test_buckets_from_the_live_actor_make_the_engine_match_it(actor):
    from megatron_credit.conversion import family_for_config, iter_hf_weight_buckets

    hf_config, model = actor
    engine = HFRolloutEngine(hf_config=hf_config, init_seed=123)
    state = model.state_dict()
    buckets = list(iter_hf_weight_buckets(state, family_for_config(hf_config), hf_config, bucket_bytes=1))  # one bucket per layer / tensor
    assert len(buckets) > 3, "the test should exercise several buckets"
    assert engine.update_weights(iter(buckets)) == sum(len(b) for b in buckets)

    prompts = [[5, 9, 11, 2], [40, 41], [7, 7, 7, 7, 7, 8]]
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=4, seed=0))
    padded = batch.to_padded(pad_token_id=0)
    actor_logp = _actor_logprobs(model, padded)
    stats = logprob_mismatch(padded.rollout_logprobs.double(), actor_logp, padded.response_mask)
    assert stats["max_abs_diff"] < 1e-4, stats  # float32 kernels of two implementations
    assert stats["kl_k3"] < 1e-8, stats
    assert padded.rollout_logprobs[padded.response_mask].max() < -1e-3  # not a degenerate policy

    # A changed actor (one "training step") reaches the engine on the next sync.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.update_weights(iter_hf_weight_buckets(model.state_dict(), family_for_config(hf_config), hf_config,
                                                 bucket_bytes=16 << 10))
    stale = stats
    stats = logprob_mismatch(padded.rollout_logprobs.double(), _actor_logprobs(model, padded), padded.response_mask)
    assert stats["max_abs_diff"] > 1e-3 > stale["max_abs_diff"]  # the old rollout is now off-policy
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=12, n=4, seed=0))
    padded = batch.to_padded(pad_token_id=0)
    stats = logprob_mismatch(padded.rollout_logprobs.double(), _actor_logprobs(model, padded), padded.response_mask)
    assert stats["max_abs_diff"] < 1e-4, stats
