"""Scored sample groups as one byte tensor: how samples cross a process boundary (never as pickles).

A group is what an engine leader holds after scoring: ``(samples, rewards [n] float32, correct [n] bool)``.
:func:`encode` writes a list of ``(key, group)`` as one ``uint8`` tensor, :func:`decode` reads it back:

* a header of int32 words: the item count; per item its key, sample count and whether its samples are
  multi-turn trajectories; per sample its prompt and response lengths, status, group id, sample index,
  log-prob mode, error bytes, and the routing's ``[layers, top_k]`` (-1 without), and for a trajectory its
  turns, tool calls, tool errors and environment errors; then the float64 timings of every sample;
* the payload, in header order: each group's rewards (float32) and verdicts (uint8), each sample's prompt and
  response ids (int32), log-probs (float32), error text (UTF-8, only a FAILED sample has one), routed
  experts (int16) and, for a trajectory, one int16 per response token (``2 * turn + 1`` on an observation
  token, ``2 * turn`` on an action) and its turn rewards (float32).

So a sample of P prompt and R response tokens costs ``4 (P + R) + 4 R`` bytes of tokens and log-probs, its
routing ``2 (P + R) layers top_k``, a trajectory's turns ``2 R + 4 turns + 16``, and 52 bytes of header (:func:`payload_bytes` is what the bytes carry).

>>> import torch
>>> from megatron_credit.rollout.types import FinishStatus, RolloutSample
>>> s = RolloutSample(prompt_ids=[5, 6], response_ids=[7], logprobs=torch.tensor([-0.5]), status=FinishStatus.STOPPED,
...                   group_id=3, sample_index=0, logprobs_mode="raw")
>>> [(k, ([got], r, c))] = decode(encode([(9, ([s], torch.tensor([1.0]), torch.tensor([True])))]))
>>> k, got.prompt_ids, got.response_ids, got.logprobs.tolist(), r.tolist(), c.tolist()
(9, [5, 6], [7], [-0.5], [1.0], [True])
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_credit.rollout.types import LOGPROBS_MODES, Episode, FinishStatus, RolloutSample, SampleTimings

_SAMPLE_WORDS = 9  # int32 header words per sample
_EPISODE_WORDS = 4  # a trajectory's turns, tool calls, tool errors, environment errors


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the host (an engine's tensors may live on its device; a message is built in host memory
    and goes to the device in one copy)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def encode(items: Sequence[tuple[int, Any]]) -> torch.Tensor:
    """``[(key, (samples, rewards, correct)), ...]`` as one ``uint8`` tensor (module docstring)."""
    words = [len(items)]
    times: list[float] = []
    blobs: list[torch.Tensor] = []
    for key, (samples, rewards, correct) in items:
        multi = any(s.action_mask is not None for s in samples)
        words += [int(key), len(samples), int(multi)]
        blobs += [_bytes(rewards.to(torch.float32)), _bytes(correct.to(torch.uint8))]
        for s in samples:
            err = s.error.encode()
            r = s.routed_experts
            words += [len(s.prompt_ids), len(s.response_ids), int(s.status), s.group_id, s.sample_index,
                      LOGPROBS_MODES.index(s.logprobs_mode), len(err), -1 if r is None else r.shape[1],
                      -1 if r is None else r.shape[2]]
            times += [s.timings.first_token_s, s.timings.finish_s]
            blobs += [_bytes(torch.tensor(s.prompt_ids, dtype=torch.int32)),
                      _bytes(torch.tensor(s.response_ids, dtype=torch.int32)),
                      _bytes(s.logprobs.to(torch.float32)), torch.frombuffer(bytearray(err), dtype=torch.uint8)
                      if err else torch.empty(0, dtype=torch.uint8)]
            if r is not None:
                blobs.append(_bytes(r.to(torch.int16)))
            if multi:
                ep = s.episode or Episode()
                words += [ep.turns, ep.tool_calls, ep.tool_errors, ep.env_errors]
                blobs += [_bytes(_turn_codes(s)), _bytes(torch.tensor(ep.turn_rewards, dtype=torch.float32))]
    head = torch.tensor([len(words), len(times)], dtype=torch.int32)
    return torch.cat([_bytes(head), _bytes(torch.tensor(words, dtype=torch.int32)),
                      _bytes(torch.tensor(times, dtype=torch.float64)), *blobs])


def _turn_codes(s: RolloutSample) -> torch.Tensor:
    """One int16 per response token: ``2 * turn``, plus 1 on an observation token."""
    turns = s.turn_ids if s.turn_ids is not None else torch.zeros(len(s.response_ids), dtype=torch.int16)
    obs = ~s.action_mask.bool() if s.action_mask is not None else torch.zeros(len(s.response_ids), dtype=torch.bool)
    return (2 * turns.to(torch.int32) + obs.to(torch.int32)).to(torch.int16)


class _Reader:
    def __init__(self, buf: torch.Tensor) -> None:
        self.buf, self.at = buf.cpu().contiguous(), 0

    def take(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = count * torch.empty(0, dtype=dtype).element_size()
        if self.at + size > self.buf.numel():
            raise ValueError(f"sample message truncated: {self.buf.numel()} bytes, needs at least {self.at + size}")
        out = self.buf[self.at:self.at + size].clone().view(dtype) if size else torch.empty(0, dtype=dtype)
        self.at += size
        return out


def decode(buf: torch.Tensor) -> list[tuple[int, Any]]:
    """The ``[(key, (samples, rewards, correct)), ...]`` that :func:`encode` wrote."""
    rd = _Reader(buf)
    n_words, n_times = rd.take(2, torch.int32).tolist()
    words = iter(rd.take(n_words, torch.int32).tolist())
    times = iter(rd.take(n_times, torch.float64).tolist())
    items = []
    for _ in range(next(words)):
        key, count, multi = next(words), next(words), next(words)
        rewards, correct = rd.take(count, torch.float32), rd.take(count, torch.uint8).bool()
        samples = []
        for _ in range(count):
            p, r, status, group, index, mode, err, layers, top_k = (next(words) for _ in range(_SAMPLE_WORDS))
            timings = SampleTimings(first_token_s=next(times), finish_s=next(times))
            prompt, response = rd.take(p, torch.int32).tolist(), rd.take(r, torch.int32).tolist()
            logprobs = rd.take(r, torch.float32)
            error = bytes(rd.take(err, torch.uint8).tolist()).decode() if err else ""
            routed = rd.take((p + r) * layers * top_k, torch.int16).view(p + r, layers, top_k) if layers >= 0 else None
            action = turn_ids = episode = None
            if multi:
                turns, calls, tool_errors, env_errors = (next(words) for _ in range(_EPISODE_WORDS))
                codes = rd.take(r, torch.int16)
                action, turn_ids = codes % 2 == 0, (codes // 2).to(torch.int16)
                episode = Episode(turn_rewards=tuple(rd.take(turns, torch.float32).tolist()), tool_calls=calls,
                                  tool_errors=tool_errors, env_errors=env_errors)
            samples.append(RolloutSample(prompt_ids=prompt, response_ids=response, logprobs=logprobs,
                                         status=FinishStatus(status), group_id=group, sample_index=index,
                                         logprobs_mode=LOGPROBS_MODES[mode], timings=timings, error=error,
                                         routed_experts=routed, action_mask=action, turn_ids=turn_ids,
                                         episode=episode))
        items.append((key, (samples, rewards, correct)))
    if rd.at != rd.buf.numel():
        raise ValueError(f"sample message has {rd.buf.numel() - rd.at} bytes after its last sample")
    return items


def payload_bytes(items: Sequence[tuple[int, Any]]) -> int:
    """What the samples carry: 4 bytes of id per token, 4 of log-prob per response token, their routing
    (2 bytes an expert), a trajectory's turn codes, turn rewards and counts, the groups' rewards and verdicts
    (the measure of ``transfer/sample_bytes``)."""
    total = 0
    for _, (samples, rewards, _) in items:
        total += 5 * len(rewards)
        for s in samples:
            total += 4 * (len(s.prompt_ids) + 2 * len(s.response_ids))
            if s.routed_experts is not None:
                total += 2 * s.routed_experts.numel()
            if s.action_mask is not None:
                total += 2 * len(s.response_ids) + 4 * (s.episode.turns if s.episode else 0) + 4 * _EPISODE_WORDS
    return total
