"""The "hf" engine on CUDA (the GPU fallback when vLLM is absent). NOT RUN on the CPU machines it was
written on; the same checks run on CPU in tests/rollout/test_hf_engine.py."""
import pytest
import torch

pytestmark = pytest.mark.gpu

from megatron_credit.rollout import FinishStatus, HFRolloutEngine, SamplingParams  # noqa: E402

PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11], [60]]


def _engine(device, dtype=torch.float32):
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
                      tie_word_embeddings=False)
    return HFRolloutEngine(hf_config=cfg, init_seed=0, device=device, dtype=dtype)


def test_cuda_logprobs_equal_teacher_forced_forward():
    eng = _engine("cuda")
    batch = eng.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, n=4, seed=0,
                                                 stop_token_ids=(0, 1, 2)))
    assert {s.status for s in batch.samples} <= {FinishStatus.STOPPED, FinishStatus.TRUNCATED}
    for s in batch.samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
        with torch.no_grad():
            logits = eng.model(input_ids=ids).logits[0].double()
        p = len(s.prompt_ids)
        want = torch.log_softmax(logits[p - 1 : -1] / 0.8, -1).gather(-1, ids[0, p:, None])[:, 0].cpu()
        torch.testing.assert_close(s.logprobs.double(), want, rtol=1e-4, atol=1e-4)  # TF32/cuBLAS kernels


def test_cuda_seed_reproduces_and_sleep_frees_and_restores():
    eng = _engine("cuda", torch.bfloat16)
    params = SamplingParams(max_new_tokens=8, n=2, seed=3)
    a = eng.generate(PROMPTS, params)
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.sleep()
    assert next(eng.model.parameters()).device.type == "cpu"  # level 1: to the host
    eng.wake_up()
    assert next(eng.model.parameters()).device.type == "cuda"
    b = eng.generate(PROMPTS, params)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
    # level 2 (the trainer's): the weights are dropped, woken empty, and a sync restores them
    eng.sleep_level = 2
    free = torch.cuda.memory_allocated()
    eng.sleep()
    assert torch.cuda.memory_allocated() < free
    eng.wake_up(["weights"])
    eng.update_weights([list(state.items())])
    eng.wake_up(["kv_cache"])
    c = eng.generate(PROMPTS, params)
    assert [s.response_ids for s in a.samples] == [s.response_ids for s in c.samples]
