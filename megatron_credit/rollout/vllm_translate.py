"""Translation between our rollout types and vLLM's: sampling parameters, the request plan, completions to
samples, and the samples of prompts vLLM would refuse. Pure functions (no vLLM import), tested in
``tests/rollout/test_vllm_translate.py``; the engine that calls them is ``rollout/vllm_engine.py``.
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron_credit.rollout.types import FinishStatus, RolloutSample, SamplingParams, SampleTimings

_VLLM_LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_FINISH = {"stop": FinishStatus.STOPPED, "length": FinishStatus.TRUNCATED}


def vllm_sampling_kwargs(params: SamplingParams, *, seed: int | None, n: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to ``params`` for one request of ``n``
    samples (default ``params.n``; see :func:`request_plan`); ``seed`` None: the request has no generator of
    its own (``rollout.seed_mode: per_call``).

    >>> kw = vllm_sampling_kwargs(SamplingParams(n=4, top_k=0, stop_token_ids=[2]), seed=7)
    >>> kw["n"], kw["top_k"], kw["stop_token_ids"], kw["ignore_eos"], kw["logprobs"]
    (4, 0, [2], True, 0)
    """
    return {
        "n": params.n if n is None else n,
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
    prompt: list[int], group_id: int, completion: Any, params: SamplingParams, *, wall_s: float,
    sample_offset: int = 0,
) -> RolloutSample:
    """One vLLM ``CompletionOutput`` as a :class:`RolloutSample`.

    ``sample_offset`` is added to vLLM's ``index`` (see :func:`request_plan`). A sample whose last token
    is one of ``params.stop_token_ids`` is STOPPED even when vLLM says "length" (it checks the length
    limit first), as in the "hf" engine.

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
    if status == FinishStatus.TRUNCATED and tokens and tokens[-1] in params.stop_token_ids:
        status = FinishStatus.STOPPED
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        status, logprobs = FinishStatus.FAILED, torch.zeros(len(tokens))
        error = "vLLM returned no per-token log-probs"
    else:
        logprobs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, completion.logprobs)], dtype=torch.float32)
        error = "" if status != FinishStatus.FAILED else f"vLLM finish_reason={completion.finish_reason!r}"
    return RolloutSample(
        prompt_ids=list(prompt), response_ids=tokens, logprobs=logprobs, status=status, group_id=group_id,
        sample_index=sample_offset + int(completion.index), logprobs_mode=params.logprobs_mode,
        # vLLM's offline API reports no per-sample times we trust; both fall back to the call's wall time.
        timings=SampleTimings(first_token_s=wall_s, finish_s=wall_s), error=error,
        routed_experts=routed_experts_of(completion, len(prompt) + len(tokens)),
    )


def routed_experts_of(completion: Any, num_tokens: int):
    """vLLM's routed experts of a completion (``CompletionOutput.routed_experts``, ``[positions, layers,
    top_k]`` from the first prompt token on, with ``enable_return_routed_experts``: vLLM 0.32) as
    ``[num_tokens, layers, top_k]`` int16, -1 where vLLM reported none and on the last token (never run
    through the model, as in the "hf" engine); None when it reported nothing.

    >>> import numpy as np
    >>> from types import SimpleNamespace as NS
    >>> routed_experts_of(NS(routed_experts=np.array([[[0, 2]], [[1, 3]], [[3, 0]]])), 4)[:, 0].tolist()
    [[0, 2], [1, 3], [3, 0], [-1, -1]]
    >>> routed_experts_of(NS(routed_experts=None), 4) is None
    True
    """
    import torch

    routed = getattr(completion, "routed_experts", None)
    if routed is None:
        return None
    got = torch.as_tensor(routed).to(torch.int16)
    if got.dim() != 3 or got.shape[0] > num_tokens:
        raise ValueError(f"vLLM's routed_experts has shape {tuple(got.shape)}; expected [<= {num_tokens} "
                         "positions, layers, top_k]")
    out = torch.full((num_tokens, *got.shape[1:]), -1, dtype=torch.int16)
    out[: got.shape[0]] = got
    out[-1] = -1
    return out


def request_plan(prompt_indices: Sequence[int], params: SamplingParams) -> list[tuple[int, int, int]]:
    """The vLLM requests for these prompts: ``(prompt index, first sample index, n)`` each.

    One request of ``n`` samples per prompt, except greedy with ``n > 1``, which vLLM refuses: then
    ``n`` requests of one sample each, numbered 0..n-1 (identical up to kernel non-determinism).

    >>> request_plan([0, 2], SamplingParams(n=3))
    [(0, 0, 3), (2, 0, 3)]
    >>> request_plan([5], SamplingParams(n=3, temperature=0))
    [(5, 0, 1), (5, 1, 1), (5, 2, 1)]
    """
    if params.greedy and params.n > 1:
        return [(i, j, 1) for i in prompt_indices for j in range(params.n)]
    return [(i, 0, params.n) for i in prompt_indices]


def prompt_length_error(prompt: Sequence[int], max_model_len: int) -> str:
    """Why vLLM would reject this prompt (it then rejects the whole ``generate`` call), or "".

    A prompt needs at least one free position for a new token, as in the "hf" engine.

    >>> prompt_length_error([1, 2, 3], 4), prompt_length_error([1, 2, 3, 4], 4)
    ('', 'prompt of 4 tokens leaves no room in the model context (max_model_len 4)')
    """
    if len(prompt) == 0:
        return "empty prompt (vLLM rejects it)"
    if len(prompt) >= max_model_len:
        return f"prompt of {len(prompt)} tokens leaves no room in the model context (max_model_len {max_model_len})"
    return ""


def failed_samples(prompt: Sequence[int], group_id: int, params: SamplingParams, error: str) -> list[RolloutSample]:
    """The ``params.n`` FAILED samples of a prompt the engine could not run."""
    import torch

    return [
        RolloutSample(prompt_ids=list(prompt), response_ids=[], logprobs=torch.zeros(0), status=FinishStatus.FAILED,
                      group_id=group_id, sample_index=j, logprobs_mode=params.logprobs_mode, error=error)
        for j in range(params.n)
    ]
