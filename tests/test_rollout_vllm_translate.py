"""CPU tests of the vLLM engine's pure parts: parameter translation, output conversion, lazy import."""
import importlib.util
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_credit.rollout import FinishStatus, SamplingParams
from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine, completion_to_sample, vllm_sampling_kwargs


def test_sampling_kwargs_carry_every_field():
    params = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=33, stop_token_ids=[2, 7], n=5,
                            seed=1, logprobs_mode="processed")
    assert vllm_sampling_kwargs(params, seed=99) == {
        "n": 5, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 33, "stop_token_ids": [2, 7],
        "ignore_eos": True, "logprobs": 0, "seed": 99, "detokenize": False,
    }


def _completion(index, tokens, reason, with_logprobs=True):
    logprobs = [{t: NS(logprob=-0.5 * (i + 1)), t + 1: NS(logprob=-9.0)} for i, t in enumerate(tokens)]
    return NS(index=index, token_ids=tuple(tokens), finish_reason=reason, logprobs=logprobs if with_logprobs else None)


@pytest.mark.parametrize("reason,status", [("stop", FinishStatus.STOPPED), ("length", FinishStatus.TRUNCATED),
                                           ("abort", FinishStatus.FAILED), (None, FinishStatus.FAILED)])
def test_completion_to_sample_maps_finish_reasons(reason, status):
    s = completion_to_sample([1, 2], 4, _completion(2, [10, 11, 12], reason), SamplingParams(logprobs_mode="processed"),
                             wall_s=3.0)
    assert (s.prompt_ids, s.response_ids, s.group_id, s.sample_index) == ([1, 2], [10, 11, 12], 4, 2)
    assert s.logprobs.tolist() == [-0.5, -1.0, -1.5] and s.logprobs.dtype == torch.float32
    assert s.status == status and s.logprobs_mode == "processed"
    assert (s.error != "") == (status == FinishStatus.FAILED)
    assert s.timings.finish_s == 3.0


def test_completion_without_logprobs_fails():
    s = completion_to_sample([1], 0, _completion(0, [3, 4], "stop", with_logprobs=False), SamplingParams(), wall_s=1.0)
    assert s.status == FinishStatus.FAILED and "log-probs" in s.error and s.logprobs.shape == (2,)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_raises_a_clear_import_error():
    with pytest.raises(ImportError, match=r"needs vLLM .*'hf' engine"):
        VLLMRolloutEngine(model_path="/nonexistent")


def test_constructor_validates_before_importing_vllm():
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMRolloutEngine(model_path="/x", logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMRolloutEngine(model_path="/x", sleep_level=3)
