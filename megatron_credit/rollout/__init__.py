"""Rollout engines: the engine protocol, the rollout record, the CPU/`transformers` engine, the vLLM
engine, and rollout-vs-trainer log-prob mismatch metrics.

- :mod:`~megatron_credit.rollout.types` -- ``SamplingParams``, ``RolloutSample``, ``RolloutBatch``
  (``to_padded()`` -> ``[B, T]`` tensors), ``FinishStatus`` (STOPPED / TRUNCATED / FAILED).
- :mod:`~megatron_credit.rollout.engine` -- the ``RolloutEngine`` protocol and the ``ROLLOUT_ENGINES``
  registry: "hf" (:mod:`~megatron_credit.rollout.hf_engine`) and "vllm"
  (:mod:`~megatron_credit.rollout.vllm_engine`, vLLM imported lazily; written against vLLM 0.11 and
  NOT run on the CPU machines this was developed on -- see that module's docstring).
- :mod:`~megatron_credit.rollout.sampling` -- temperature / top-k / top-p sampling as pure functions.
- :mod:`~megatron_credit.rollout.weight_sync` -- in-place copy of HF-named tensor buckets.
- :mod:`~megatron_credit.rollout.mismatch` -- ``logprob_mismatch`` (its correction in the loss:
  ``losses/importance.py``).

Importing this package imports torch only; `transformers` is imported when an "hf" engine is built.
"""
from megatron_credit.rollout.engine import ROLLOUT_ENGINES, RolloutEngine, WeightBuckets, build_rollout_engine
from megatron_credit.rollout.hf_engine import HFRolloutEngine
from megatron_credit.rollout.mismatch import logprob_mismatch
from megatron_credit.rollout.types import (
    FinishStatus,
    PaddedRollout,
    RolloutBatch,
    RolloutSample,
    SampleTimings,
    SamplingParams,
)
from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "FinishStatus",
    "HFRolloutEngine",
    "PaddedRollout",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "SampleTimings",
    "SamplingParams",
    "VLLMRolloutEngine",
    "WeightBuckets",
    "build_rollout_engine",
    "logprob_mismatch",
]
