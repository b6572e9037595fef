"""The vLLM rollout engine (GPU): colocated with the actor, weights synced as HF-named tensors.

**Status: written against the documented API of vLLM 0.11.0 (V1 engine) and NOT run here** -- the
machines this project was developed on have no GPU, and vLLM cannot be installed on them (it pins a
CUDA build of torch). Its test (``tests/test_rollout_vllm_gpu.py``) is marked ``gpu``. The pieces that
do not need vLLM -- translation of our ``SamplingParams`` into vLLM's and of vLLM's outputs into
``RolloutSample`` -- are plain functions tested on CPU. Without vLLM, use the "hf" engine
(:mod:`megatron_credit.rollout.hf_engine`), which also runs on CUDA.

The vLLM 0.11 API used, and what we rely on:

- ``vllm.LLM(model=..., skip_tokenizer_init=True, tensor_parallel_size=..., enable_sleep_mode=True,
  logprobs_mode="raw_logprobs" | "processed_logprobs", worker_extension_cls=..., seed=...)``.
  ``load_format="dummy"`` skips reading weights from disk when the first ``update_weights`` comes
  before the first ``generate`` (the RL loop's order).
- ``LLM.generate([TokensPrompt(prompt_token_ids=...)], [vllm.SamplingParams(...)], use_tqdm=False)``
  with ``SamplingParams(n, temperature, top_p, top_k, max_tokens, stop_token_ids, ignore_eos=True,
  logprobs=0, seed, detokenize=False)``: ``logprobs=0`` returns the sampled token's log-prob only;
  ``ignore_eos=True`` makes our ``stop_token_ids`` the only stop rule, as in the "hf" engine. Each
  ``CompletionOutput`` gives ``index`` (sample index), ``token_ids`` (the stop token included),
  ``logprobs`` (one ``{token_id: Logprob}`` per position) and ``finish_reason`` ("stop" / "length").
  Seeds: each prompt gets ``row_seed(seed, group_id, 0)`` (31 bits) and vLLM V1 seeds its j-th child
  request with ``seed + j``, so samples are reproducible per group, though not the same draws as the
  "hf" engine's. Seeded requests take vLLM's per-request-generator sampling path.
- ``logprobs_mode`` is an engine-wide setting in vLLM, so an engine serves one mode, and every sample
  records it. vLLM's ``raw_logprobs`` are taken *before* temperature scaling (``log_softmax(logits)``)
  while ours are ``log_softmax(logits / T)``; the two agree only at T = 1 (or greedy), so "raw" with
  any other temperature is refused. ``processed_logprobs`` (after temperature, top-k, top-p) match
  our "processed".
- Sleep mode: ``LLM.sleep(level=1)`` offloads weights to host memory and drops the KV cache;
  ``LLM.wake_up(tags=["weights"])`` then ``LLM.wake_up(tags=["kv_cache"])`` bring them back in two
  steps so that weights can be overwritten before the KV cache is re-allocated (less peak memory).
  ``level=2`` drops the weights too (use it when a full weight sync always follows).
- Weight sync: ``LLM.collective_rpc("load_hf_weights", args=(bucket,))`` runs
  :class:`~megatron_credit.rollout.vllm_worker.WeightSyncExtension` on every TP worker, which calls
  vLLM's ``model.load_weights`` (it shards and fuses HF-named tensors itself); then
  ``LLM.reset_prefix_cache()`` so no KV computed with the old weights is reused. Unlike the "hf"
  engine, vLLM's loaders do not report parameters that no bucket covered, and skip (as another
  pipeline stage's) names with a layer index beyond the model. With the default
  multiprocess executor the bucket is pickled to the workers (a host copy); in-process executors
  (TP = 1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ``distributed_executor_backend=
  "external_launcher"``) pass tensors by reference. A CUDA-IPC path is future work.
"""
from __future__ import annotations

import gc
import secrets
import time
from typing import Any, Sequence

from megatron_credit.rollout.engine import ROLLOUT_ENGINES, WeightBuckets, resolve_group_ids
from megatron_credit.rollout.sampling import row_seed
from megatron_credit.rollout.types import FinishStatus, RolloutBatch, RolloutSample, SamplingParams, SampleTimings

VLLM_API_VERSION = "0.11.0"
"""The vLLM release whose documented API this engine is written against."""

WORKER_EXTENSION = "megatron_credit.rollout.vllm_worker.WeightSyncExtension"

_VLLM_LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_FINISH = {"stop": FinishStatus.STOPPED, "length": FinishStatus.TRUNCATED}


def vllm_sampling_kwargs(params: SamplingParams, *, seed: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to ``params`` for one prompt.

    >>> kw = vllm_sampling_kwargs(SamplingParams(n=4, top_k=0, stop_token_ids=[2]), seed=7)
    >>> kw["n"], kw["top_k"], kw["stop_token_ids"], kw["ignore_eos"], kw["logprobs"]
    (4, 0, [2], True, 0)
    """
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 disables top-k in vLLM 0.11 as here
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "seed": seed,
        "detokenize": False,
    }


def completion_to_sample(
    prompt: list[int], group_id: int, completion: Any, params: SamplingParams, *, wall_s: float
) -> RolloutSample:
    """One vLLM ``CompletionOutput`` as a :class:`RolloutSample`.

    >>> from types import SimpleNamespace as NS
    >>> c = NS(index=1, token_ids=[5, 2], finish_reason="stop",
    ...        logprobs=[{5: NS(logprob=-0.5), 9: NS(logprob=-3.0)}, {2: NS(logprob=-0.25)}])
    >>> s = completion_to_sample([1, 4], 3, c, SamplingParams(), wall_s=1.0)
    >>> s.response_ids, s.logprobs.tolist(), s.status.name, s.sample_index
    ([5, 2], [-0.5, -0.25], 'STOPPED', 1)
    """
    import torch

    tokens = [int(t) for t in completion.token_ids]
    status = _FINISH.get(completion.finish_reason, FinishStatus.FAILED)
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        status, logprobs = FinishStatus.FAILED, torch.zeros(len(tokens))
        error = "vLLM returned no per-token log-probs"
    else:
        logprobs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, completion.logprobs)], dtype=torch.float32)
        error = "" if status != FinishStatus.FAILED else f"vLLM finish_reason={completion.finish_reason!r}"
    return RolloutSample(
        prompt_ids=list(prompt), response_ids=tokens, logprobs=logprobs, status=status, group_id=group_id,
        sample_index=int(completion.index), logprobs_mode=params.logprobs_mode,
        # vLLM's offline API reports no per-sample times we trust; both fall back to the call's wall time.
        timings=SampleTimings(first_token_s=wall_s, finish_s=wall_s), error=error,
    )


@ROLLOUT_ENGINES.register("vllm")
class VLLMRolloutEngine:
    """Rollout engine over ``vllm.LLM`` with sleep mode and in-memory weight sync (see module docstring).

    ``logprobs_mode`` ("raw" or "processed") is fixed per engine because vLLM fixes it per engine.
    ``engine_kwargs`` pass through to ``vllm.LLM`` (e.g. ``max_model_len``, ``enforce_eager``,
    ``distributed_executor_backend``).
    """

    def __init__(
        self,
        *,
        model_path: str,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        logprobs_mode: str = "raw",
        seed: int = 0,
        sleep_level: int = 1,
        load_format: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if logprobs_mode not in _VLLM_LOGPROBS_MODE:
            raise ValueError(f"logprobs_mode must be one of {sorted(_VLLM_LOGPROBS_MODE)}, got {logprobs_mode!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "the 'vllm' rollout engine needs vLLM (CUDA only; written against vllm=="
                f"{VLLM_API_VERSION}): pip install 'megatron-credit[gpu]' on a GPU machine, or use the "
                "'hf' engine"
            ) from e
        self._vllm = vllm
        self.logprobs_mode = logprobs_mode
        self.sleep_level = sleep_level
        self._llm = vllm.LLM(
            model=model_path, skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=True,
            logprobs_mode=_VLLM_LOGPROBS_MODE[logprobs_mode], worker_extension_cls=WORKER_EXTENSION,
            load_format=load_format, **(engine_kwargs or {}),
        )
        # "awake", "asleep", or "weights" (weights on the GPU, KV cache not yet re-allocated).
        self._state = "awake"
        # Dummy weights, or weights dropped by level-2 sleep, must be overwritten before generating.
        self._weights_valid = load_format != "dummy"

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, group_ids: Sequence[int] | None = None
    ) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; see :class:`RolloutEngine`."""
        if self._state != "awake":
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        if not self._weights_valid:
            raise RuntimeError("the engine holds no valid weights (dummy load or level-2 sleep): update_weights first")
        if params.logprobs_mode != self.logprobs_mode:
            raise ValueError(f"this vLLM engine was built with logprobs_mode={self.logprobs_mode!r} "
                             f"(fixed per engine in vLLM); got {params.logprobs_mode!r}")
        if params.logprobs_mode == "raw" and params.temperature not in (0.0, 1.0):
            raise ValueError("vLLM's raw_logprobs are taken before temperature scaling: use temperature 1 "
                             "(or 0) with logprobs_mode='raw', or logprobs_mode='processed'")
        gids = resolve_group_ids(len(prompts), group_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        from vllm.inputs import TokensPrompt

        # One vLLM seed per prompt (vLLM derives the n samples of a request from it), kept within 31 bits.
        sampling = [self._vllm.SamplingParams(**vllm_sampling_kwargs(params, seed=row_seed(seed, g, 0) >> 32))
                    for g in gids]
        start = time.perf_counter()
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling,
                                     use_tqdm=False)
        wall = time.perf_counter() - start
        samples = [
            completion_to_sample(prompt, g, c, params, wall_s=wall)
            for prompt, g, request in zip(prompts, gids, outputs)
            for c in sorted(request.outputs, key=lambda c: c.index)
        ]
        return RolloutBatch(samples=samples, wall_s=wall)

    def update_weights(self, buckets: WeightBuckets) -> int:
        """Load HF-named tensor buckets into every TP worker; returns the tensor count of rank 0."""
        if self._state == "asleep":
            self._llm.wake_up(tags=["weights"])
            self._state = "weights"
        count = 0
        for bucket in buckets:
            bucket = [(name, t.detach().contiguous()) for name, t in bucket]
            try:
                count += self._llm.collective_rpc("load_hf_weights", args=(bucket,))[0]
            except Exception as e:  # vLLM raises KeyError / AssertionError deep in its weight loaders
                names = [n for n, _ in bucket]
                raise ValueError(f"vLLM failed to load the weight bucket {names[:4]}{'...' if len(names) > 4 else ''}: "
                                 f"{type(e).__name__}: {e}") from e
        self._llm.reset_prefix_cache()
        self._weights_valid = True
        return count

    def sleep(self) -> None:
        if self._state != "asleep":
            self._llm.sleep(level=self.sleep_level)
            self._state = "asleep"
            if self.sleep_level == 2:
                self._weights_valid = False

    def wake_up(self) -> None:
        if self._state == "asleep":
            self._llm.wake_up()
        elif self._state == "weights":
            self._llm.wake_up(tags=["kv_cache"])
        self._state = "awake"

    def close(self) -> None:
        engine_core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self._llm = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
