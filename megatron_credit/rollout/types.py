"""Typed rollout records (docs/architecture.md, convention 8): what an engine returns and what it was asked to do.

A rollout is a list of :class:`RolloutSample` -- one response to one prompt, with the engine's
per-token log-probs, how it ended and which group (prompt) it belongs to -- wrapped in a
:class:`RolloutBatch`. The trainer turns a batch into right-padded ``[B, T]`` tensors with
:meth:`RolloutBatch.to_padded` (a mixture of experts' routing stays ragged: ``batch/ragged.py``).

>>> s = RolloutSample(prompt_ids=[5, 6], response_ids=[7, 2], logprobs=torch.tensor([-0.5, -1.0]),
...                   status=FinishStatus.STOPPED, group_id=3, sample_index=0, logprobs_mode="raw")
>>> p = RolloutBatch(samples=[s], wall_s=0.1).to_padded(pad_token_id=0)
>>> p.input_ids.tolist(), p.response_mask.tolist(), p.rollout_logprobs.tolist()
([[5, 6, 7, 2]], [[False, False, True, True]], [[0.0, 0.0, -0.5, -1.0]])
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from megatron_credit.batch.ragged import RaggedRouting

LOGPROBS_MODES = ("raw", "processed")


class FinishStatus(enum.IntEnum):
    """How a sample ended. Integer-valued so a batch's statuses fit in one tensor."""

    STOPPED = 0
    """A stop token was sampled; it is the last response token."""
    TRUNCATED = 1
    """``max_new_tokens`` (or the model's context length) was reached before a stop token."""
    FAILED = 2
    """The engine could not produce this sample (e.g. non-finite logits, prompt too long); see ``error``."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. The same object drives every engine; engines reject what they cannot honour."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), whose log-probs are then taken at temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off). Applied before top_p, as vLLM does."""
    max_new_tokens: int = 128
    """Upper bound on response length; a sample that reaches it without a stop token is TRUNCATED."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (typically EOS); the stop token is kept as the last response token."""
    n: int = 1
    """Samples per prompt (the group size of GRPO-style estimators)."""
    seed: int | None = None
    """Base seed. Each sample's randomness depends only on (seed, group id, sample index), so results
    do not depend on batch composition. None draws fresh entropy. Vary it per iteration."""
    logprobs_mode: str = "raw"
    """Which log-probs samples carry: "raw" = full-vocabulary ``log_softmax(logits / temperature)``
    (what the trainer recomputes); "processed" = after top-k/top-p filtering and renormalisation
    (the distribution actually sampled from). Greedy (temperature 0) reports the unfiltered
    ``log_softmax(logits)`` in both modes, as vLLM does."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        # A list would make the frozen dataclass unhashable and is easy to pass by accident.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class SampleTimings:
    """Wall-clock seconds, measured from the start of the ``generate`` call that produced the sample."""

    first_token_s: float = 0.0
    """Time until this sample's first response token existed (prefill plus queueing)."""
    finish_s: float = 0.0
    """Time until this sample ended."""


@dataclass(frozen=True, kw_only=True)
class Episode:
    """What a multi-turn episode did beyond its tokens (``rollout/multi_turn.py``)."""

    turn_rewards: tuple[float, ...] = ()
    """The environment's reward of each model turn (added to the verifier's score; the estimators that take
    per-token rewards place turn ``k``'s at that turn's last action token)."""
    tool_calls: int = 0
    """Tool calls the episode made."""
    tool_errors: int = 0
    """Tool calls answered with the environment's error observation (malformed, failed, timed out, killed)."""
    env_errors: int = 0
    """Environment failures: a ``start`` or ``step`` that raised, overran ``env.step_timeout_s`` or returned
    something the loop cannot use (the episode ended there; the sample's ``error`` says why)."""

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def aborted(self) -> bool:
        """The environment failed: the episode is scored by the abort rule (incorrect), not the verifier."""
        return self.env_errors > 0


@dataclass(kw_only=True)
class RolloutSample:
    """One response to one prompt."""

    prompt_ids: list[int]
    """Prompt token ids (no padding)."""
    response_ids: list[int]
    """Generated token ids, including the stop token when ``status`` is STOPPED."""
    logprobs: torch.Tensor
    """[len(response_ids)] float32: engine log-prob of each response token, under ``logprobs_mode``."""
    status: FinishStatus
    """How the sample ended."""
    group_id: int
    """Id of the prompt group (all n samples of one prompt share it)."""
    sample_index: int
    """Index of this sample within its group, in [0, n)."""
    logprobs_mode: str
    """"raw" or "processed": which distribution ``logprobs`` were taken from (see SamplingParams)."""
    timings: SampleTimings = field(default_factory=SampleTimings)
    error: str = ""
    """Why the sample FAILED, or why its environment failed (a trajectory ended by the abort rule,
    ``Episode.aborted``: the ``env/error_reasons`` metric counts these); empty otherwise."""
    routed_experts: torch.Tensor | None = None
    """A mixture-of-experts engine's routing: ``[num_tokens, layers, top_k]`` int16, the experts each token
    (prompt, then response) was sent to in each MoE layer, -1 for a token the engine never ran through the
    model (the last sampled token); None for a dense model or an engine that does not report it. The trainer
    replays it (``moe.routing_replay``)."""
    action_mask: torch.Tensor | None = None
    """``[len(response_ids)]`` bool of a multi-turn trajectory: True on the policy's tokens (actions), False on
    the environment's (observations between turns: context, never trained on); None for a single-turn
    response, every token of which is an action."""
    turn_ids: torch.Tensor | None = None
    """``[len(response_ids)]`` int16 of a multi-turn trajectory: the turn of each response token (an
    observation belongs to the turn it answers); None for a single-turn response (all turn 0)."""
    episode: Episode | None = None
    """A multi-turn trajectory's turn rewards, tool calls and errors; None for a single-turn response."""

    def __post_init__(self):
        if self.logprobs.shape != (len(self.response_ids),):
            raise ValueError(
                f"logprobs must have shape [{len(self.response_ids)}] (one per response token), "
                f"got {tuple(self.logprobs.shape)}"
            )
        r = self.routed_experts
        if r is not None and (r.dim() != 3 or r.shape[0] != self.num_tokens):
            raise ValueError(f"routed_experts must have shape [{self.num_tokens}, layers, top_k] (one row per "
                             f"prompt and response token), got {tuple(r.shape)}")
        for name in ("action_mask", "turn_ids"):
            t = getattr(self, name)
            if t is not None and t.shape != (len(self.response_ids),):
                raise ValueError(f"{name} must have shape [{len(self.response_ids)}] (one per response token), "
                                 f"got {tuple(t.shape)}")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True, kw_only=True)
class PaddedRollout:
    """A rollout batch as right-padded tensors, row b = sample b of the batch.

    Position t of a row holds token ``input_ids[b, t]``; ``rollout_logprobs[b, t]`` is the engine's
    ``log p(input_ids[b, t] | input_ids[b, :t])`` at response positions and 0 elsewhere, i.e. it is
    aligned with the token it scores (a trainer whose logits at t predict t+1 shifts by one).
    """

    input_ids: torch.Tensor
    """[B, T] int64: prompt then response, right-padded with ``pad_token_id``."""
    attention_mask: torch.Tensor
    """[B, T] bool: True on prompt and response tokens."""
    response_mask: torch.Tensor
    """[B, T] bool: True on response tokens only (the tokens the policy is trained on); in a multi-turn
    trajectory the policy's tokens only, never the environment's observations (``obs_mask``)."""
    rollout_logprobs: torch.Tensor
    """[B, T] float32: engine log-probs at response positions, 0 elsewhere."""
    prompt_lens: torch.Tensor
    """[B] int64."""
    response_lens: torch.Tensor
    """[B] int64."""
    group_ids: torch.Tensor
    """[B] int64: prompt group of each row."""
    status: torch.Tensor
    """[B] int64: FinishStatus value of each row."""
    routed_experts: RaggedRouting | None = None
    """Each row's routed experts, not padded: the samples' own ``[num_tokens, layers, top_k]`` int16 tensors
    (:attr:`RolloutSample.routed_experts`; a row without any holds None), which each micro-batch gathers
    into its padded or packed form (``batch/ragged.py``); None when no sample carries them."""
    obs_mask: torch.Tensor | None = None
    """[B, T] bool: True on the environment's tokens inside a multi-turn trajectory (observations; never in
    ``response_mask``); None when no sample is multi-turn."""
    turn_ids: torch.Tensor | None = None
    """[B, T] int64: the turn of each response token, -1 elsewhere; None when no sample is multi-turn."""
    turn_rewards: torch.Tensor | None = None
    """[B, K] float32: each row's turn rewards (K = the most turns of a row; 0 past a row's last turn); None
    when no sample is multi-turn."""


@dataclass(kw_only=True)
class RolloutBatch:
    """The samples of one ``generate`` call, ordered prompt-major: (prompt 0, sample 0..n-1), ..."""

    samples: list[RolloutSample]
    wall_s: float = 0.0
    """Wall-clock seconds of the whole ``generate`` call."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def response_tokens_per_s(self) -> float:
        return self.num_response_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_padded(self, *, pad_token_id: int, max_len: int | None = None) -> PaddedRollout:
        """Right-pad into [B, T] tensors (T = longest prompt+response, or ``max_len`` if larger); the routing
        stays one tensor per sample (:attr:`PaddedRollout.routed_experts`)."""
        if not self.samples:
            raise ValueError("cannot pad an empty rollout batch")
        lens = [s.num_tokens for s in self.samples]
        t = max(lens) if max_len is None else max_len
        if t < max(lens):
            raise ValueError(f"max_len={max_len} is shorter than the longest sample ({max(lens)} tokens)")
        b = len(self.samples)
        input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((b, t), dtype=torch.bool)
        response_mask = torch.zeros((b, t), dtype=torch.bool)
        logprobs = torch.zeros((b, t), dtype=torch.float32)
        routed = RaggedRouting.of([s.routed_experts for s in self.samples])  # ragged: never padded here
        multi = any(s.action_mask is not None for s in self.samples)
        obs_mask = torch.zeros((b, t), dtype=torch.bool) if multi else None
        turn_ids = torch.full((b, t), -1, dtype=torch.long) if multi else None
        turn_rewards = None
        if multi:
            turns = max((s.episode.turns if s.episode is not None else 1) for s in self.samples)
            turn_rewards = torch.zeros((b, max(turns, 1)), dtype=torch.float32)
        for i, s in enumerate(self.samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
            attention_mask[i, : p + r] = True
            response_mask[i, p : p + r] = True if s.action_mask is None else s.action_mask.bool()
            if multi:
                obs_mask[i, p : p + r] = False if s.action_mask is None else ~s.action_mask.bool()
                turn_ids[i, p : p + r] = 0 if s.turn_ids is None else s.turn_ids.long()
                if s.episode is not None and s.episode.turns:
                    turn_rewards[i, : s.episode.turns] = torch.tensor(s.episode.turn_rewards, dtype=torch.float32)
            logprobs[i, p : p + r] = s.logprobs.float()
        return PaddedRollout(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            prompt_lens=torch.tensor([len(s.prompt_ids) for s in self.samples], dtype=torch.long),
            response_lens=torch.tensor([len(s.response_ids) for s in self.samples], dtype=torch.long),
            group_ids=torch.tensor([s.group_id for s in self.samples], dtype=torch.long),
            status=torch.tensor([int(s.status) for s in self.samples], dtype=torch.long),
            routed_experts=routed,
            obs_mask=obs_mask,
            turn_ids=turn_ids,
            turn_rewards=turn_rewards,
        )
