"""CPU tests of the vLLM engine's pure parts: parameter translation, output conversion, lazy import,
executor/weight-transfer validation, the prompt-length pre-check (with a stand-in for ``vllm.LLM``), and
the IPC packing + worker extension (CPU tensors, through a stand-in for vLLM's msgpack transport)."""
import importlib.util
import inspect
import sys
from types import ModuleType
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_credit.rollout import FinishStatus, SamplingParams
from megatron_credit.rollout import vllm_worker
from megatron_credit.rollout.vllm_engine import (
    VLLMRolloutEngine,
    completion_to_sample,
    failed_samples,
    prompt_length_error,
    vllm_sampling_kwargs,
    weight_transfer_env,
)
from megatron_credit.rollout.vllm_worker import WeightSyncExtension, pack_ipc_bucket, unpack_ipc_bucket


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


def test_constructor_validates_before_importing_vllm(monkeypatch):
    from megatron_credit.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "_cuda_available", lambda: True)  # GPU defaults (cuda_ipc)
    # a clean environment: an engine started earlier in this process (tests/rollout/test_vllm_engine_cpu.py) leaves
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 behind, which turns the third refusal into "environment sets ..."
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMRolloutEngine(model_path="/x", logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMRolloutEngine(model_path="/x", sleep_level=3)
    with pytest.raises(ValueError, match="allow_insecure_serialization=False forbids it"):
        VLLMRolloutEngine(model_path="/x", allow_insecure_serialization=False)  # the default cuda_ipc transfer
    with pytest.raises(ValueError, match="v1_multiprocessing=False"):
        VLLMRolloutEngine(model_path="/x", weight_transfer="in_process", v1_multiprocessing=True)


# ------------------------------------------------------------------------- executor / transfer checks
def _env(mode, *, tp=1, mp=True, insecure=None, backend=None, environ=None):
    return weight_transfer_env(mode, tensor_parallel_size=tp, v1_multiprocessing=mp,
                               allow_insecure_serialization=insecure, distributed_executor_backend=backend,
                               environ=environ or {})


def test_weight_transfer_env_accepts_the_supported_setups():
    ipc = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert _env("cuda_ipc") == ipc and _env("cuda_ipc", tp=4, backend="mp") == ipc
    assert _env("cuda_ipc", environ={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}) == ipc
    local = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert _env("in_process", mp=False, insecure=False) == local
    assert _env("in_process", mp=False, backend="uni") == local
    assert _env("in_process", tp=2, mp=False, backend="external_launcher") == local


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="nccl"), "weight_transfer must be one of"),
    (dict(mode="cuda_ipc", insecure=False), "allow_insecure_serialization=False forbids"),
    (dict(mode="cuda_ipc", environ={"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"}), "environment sets"),
    (dict(mode="cuda_ipc", mp=False), "cannot open its own CUDA IPC handles"),
    (dict(mode="cuda_ipc", backend="external_launcher"), "cannot open its own CUDA IPC handles"),
    (dict(mode="in_process"), "v1_multiprocessing=False"),
    (dict(mode="in_process", mp=False, tp=2), "external_launcher"),
    (dict(mode="in_process", mp=False, backend="mp"), "external_launcher"),
    (dict(mode="cuda_ipc", environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), "environment sets"),
    (dict(mode="in_process", mp=False, environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}), "environment sets"),
])
def test_weight_transfer_env_rejects_setups_that_cannot_work(kwargs, match):
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=match):
        _env(mode, **kwargs)


# ------------------------------------------------------------------------------ prompt-length pre-check
def test_prompt_length_error_and_failed_samples():
    assert prompt_length_error([1] * 7, 8) == ""
    assert "8 tokens" in prompt_length_error([1] * 8, 8) and "max_model_len 8" in prompt_length_error([1] * 9, 8)
    assert "empty" in prompt_length_error([], 8)
    out = failed_samples([4, 5], 3, SamplingParams(n=2, logprobs_mode="processed"), "too long")
    assert [(s.group_id, s.sample_index, s.status, s.error, s.response_ids) for s in out] == [
        (3, 0, FinishStatus.FAILED, "too long", []), (3, 1, FinishStatus.FAILED, "too long", [])]
    assert all(s.logprobs.shape == (0,) and s.logprobs_mode == "processed" for s in out)


class _FakeLLM:
    """Stands in for ``vllm.LLM.generate``: rejects the whole call for one over-long prompt, as vLLM does."""

    def __init__(self, max_model_len):
        self.max_model_len, self.calls = max_model_len, []

    def generate(self, prompts, sampling, use_tqdm):
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        if any(len(p["prompt_token_ids"]) > self.max_model_len for p in prompts):
            raise ValueError("prompt is longer than the maximum model length")
        return [NS(outputs=[_completion(j, [p["prompt_token_ids"][0] + 100 + j], "length")
                            for j in reversed(range(s["n"]))]) for p, s in zip(prompts, sampling)]


def _fake_engine(monkeypatch, max_model_len):
    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    eng = object.__new__(VLLMRolloutEngine)  # skip __init__: no vLLM here
    eng._vllm, eng._llm, eng.max_model_len = vllm, _FakeLLM(max_model_len), max_model_len
    eng.logprobs_mode, eng._state, eng._weights_valid, eng._dead = "raw", "awake", True, ""
    eng.seed_mode, eng._in_process = "per_sample", True
    return eng


def test_generate_fails_only_the_prompts_vllm_would_reject(monkeypatch):
    eng = _fake_engine(monkeypatch, max_model_len=6)
    prompts = [[1, 2], [3] * 6, [4, 5, 6, 7, 8], [9] * 10, [], [7]]
    batch = eng.generate(prompts, SamplingParams(n=2, seed=0), group_ids=[10, 11, 12, 13, 14, 15])
    assert eng._llm.calls == [[[1, 2], [4, 5, 6, 7, 8], [7]]]  # only the runnable prompts were sent
    got = [(s.group_id, s.sample_index, s.status, s.response_ids) for s in batch.samples]
    F, T = FinishStatus.FAILED, FinishStatus.TRUNCATED
    assert got == [(10, 0, T, [101]), (10, 1, T, [102]), (11, 0, F, []), (11, 1, F, []),
                   (12, 0, T, [104]), (12, 1, T, [105]), (13, 0, F, []), (13, 1, F, []),
                   (14, 0, F, []), (14, 1, F, []), (15, 0, T, [107]), (15, 1, T, [108])]
    assert [s.prompt_ids for s in batch.samples][2:4] == [[3] * 6] * 2
    assert "6 tokens" in batch.samples[2].error and "empty" in batch.samples[8].error
    # All prompts rejected: vLLM is not called at all.
    assert all(s.status == F for s in eng.generate([[1] * 6], SamplingParams(n=1)).samples)
    assert len(eng._llm.calls) == 1


# ------------------------------------------------------------------------------ IPC packing + worker side
def _msgpack_like(obj):
    """What vLLM's msgpack transport (untyped decoder) does to containers: tuples become lists."""
    if isinstance(obj, (tuple, list)):
        return [_msgpack_like(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _msgpack_like(v) for k, v in obj.items()}
    return obj


def test_ipc_device_arg_matches_torch_rebuild_cuda_tensor():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[vllm_worker.IPC_DEVICE_ARG] == "storage_device"


def test_pack_unpack_round_trip_on_cpu_through_list_transport():
    gen = torch.Generator().manual_seed(0)
    bucket = [("a.weight", torch.randn(3, 4, generator=gen)), ("b.bias", torch.randn(5, generator=gen)),
              ("c.weight", torch.randn(4, 6, generator=gen).t()[1:3]),  # non-contiguous view, storage offset
              ("d.weight", torch.randn(2, 2, generator=gen, dtype=torch.float64).to(torch.bfloat16))]
    packed = pack_ipc_bucket(bucket)
    assert packed["device_uuid"] is None and [n for n, _, _ in packed["tensors"]] == [n for n, _ in bucket]
    out = unpack_ipc_bucket(_msgpack_like(packed), device_index=None)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, want), (_, got) in zip(bucket, out):
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)


def test_pack_rejects_mixed_devices_and_unpack_sets_the_receivers_device(monkeypatch):
    with pytest.raises(ValueError, match="one device"):
        pack_ipc_bucket([("a", torch.zeros(1)), ("b", torch.zeros(1, device="meta"))])
    seen = []

    def fake_rebuild_cuda_tensor(*args):
        seen.append(args)
        return torch.zeros(1)

    monkeypatch.setattr(vllm_worker, "rebuild_cuda_tensor", fake_rebuild_cuda_tensor)
    args = (torch.Tensor, (2,), (1,), 0, "storage_cls", torch.float32, 0, b"handle")
    packed = {"device_uuid": "GPU-x", "tensors": [("w", fake_rebuild_cuda_tensor, args)]}
    unpack_ipc_bucket(_msgpack_like(packed), device_index=3)
    assert seen[0][vllm_worker.IPC_DEVICE_ARG] == 3 and seen[0][7] == b"handle"
    with pytest.raises(ValueError, match="device index"):
        unpack_ipc_bucket(packed, device_index=None)


class _Worker(WeightSyncExtension):
    """A vLLM worker stand-in: ``model.load_weights`` copies HF-named tensors into a torch model."""

    def __init__(self):
        self.device = "cpu"
        model = torch.nn.Linear(4, 3)

        def load_weights(weights):
            params = dict(model.named_parameters())
            loaded = set()
            for name, t in weights:
                params[name].data.copy_(t)
                loaded.add(name)
            return loaded

        model.load_weights = load_weights
        self.model_runner = NS(model=model)


def test_worker_loads_ipc_and_in_process_buckets():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    worker = _Worker()
    assert worker.load_ipc_weights(_msgpack_like(pack_ipc_bucket([("weight", w), ("bias", b)]))) == 2
    assert torch.equal(worker.model_runner.model.weight, w) and torch.equal(worker.model_runner.model.bias, b)
    assert worker.load_hf_weights([("bias", 2 * b)]) == 1
    assert torch.equal(worker.model_runner.model.bias, 2 * b)
    assert worker.hf_weight_names() == ["weight", "bias"]
