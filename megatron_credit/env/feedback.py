"""The feedback environment: every model turn is an attempt at the answer; a wrong one gets the verifier's
verdict as an observation and another try, up to ``env.max_turns`` attempts. Works with any data source:
the verdict is that of the verifier the record's ``data_source`` names (``rewards.base.VERIFIER_BY_DATA_SOURCE``),
the one that scores the trajectory's last turn at the end.

- The attempt is correct: the episode ends (``done``); the final score is the verifier's +1.
- The verifier found an answer and it is wrong: ``incorrect_text`` with ``{answer}`` replaced by the
  answer it read, and ``retry_reward`` (0 by default; below 0, a later right answer earns less).
- It found no answer: ``no_answer_text``, and ``retry_reward``.
- The verifier could not score the record (a bad ground truth, a timeout): the episode ends; no try can
  change that.

A chat model ends each attempt with its EOS, which would end a trajectory in the rollout loop;
this environment sets :attr:`Feedback.continues_after_eos`, so the observation follows the EOS and the
model goes on. The observation's text is appended as it is: for a chat model, write the user-turn markers
of its template into the texts (docs/multi_turn.md). The attempt's text reaches :meth:`step` with its
EOS decoded as text (``42<|im_end|>``); ``end_texts`` are removed from its end before the verifier reads
it, as the final score's text leaves special tokens out.

The verifier runs in the step's thread, in this process: the sources' own verifiers (the synthetic tasks,
reasoning-gym's scorers) are quick; a hung one is ended by the loop's ``env.step_timeout_s``.

>>> env = Feedback(Feedback.Config())
>>> from types import SimpleNamespace as R
>>> state = env.start(R(data_source="synthetic_arith", ground_truth="12"))
>>> env.step(state, " 13"), env.step(state, " 12").done
(StepResult(observation='\\nWrong: 13. Try again.\\n', reward=0.0, done=False, tool_calls=0, tool_error=False), True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from megatron_credit.env.base import ENVIRONMENTS, Environment, StepResult


@ENVIRONMENTS.register("feedback")
class Feedback(Environment):
    """Retries with the verifier's verdict (module docstring). Stateless across episodes; thread-safe."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Environment.Config):
        """The feedback environment's options (a recipe's ``env.options``)."""

        incorrect_text: str = "\nWrong: {answer}. Try again.\n"
        """Observation after a wrong answer; ``{answer}`` is the answer the verifier read."""
        no_answer_text: str = "\nNo answer found. Try again.\n"
        """Observation after an attempt in which the verifier found no answer."""
        retry_reward: float = 0.0
        """Reward of each wrong attempt that gets another try."""
        stop_text: Optional[str] = None
        """A text that ends an attempt besides EOS (e.g. ``</answer>``); it must be one token. None: EOS only."""
        end_texts: tuple[str, ...] = ()
        """Texts removed from the end of an attempt before the verifier reads it: the tokenizer's EOS as
        text (``<|im_end|>``, ``</s>``)."""

        def __post_init__(self) -> None:
            try:
                self.incorrect_text.format(answer="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"env.options.incorrect_text may only name {{answer}}, got "
                                 f"{self.incorrect_text!r} ({type(exc).__name__}: {exc})") from None
            if not (isinstance(self.retry_reward, (int, float)) and math.isfinite(self.retry_reward)):
                raise ValueError(f"env.options.retry_reward must be a finite number, got {self.retry_reward!r}")
            if self.stop_text is not None and not self.stop_text:
                raise ValueError("env.options.stop_text must be a non-empty string or null")
            if any(not t for t in self.end_texts):
                raise ValueError(f"env.options.end_texts must hold non-empty strings, got {list(self.end_texts)}")

    continues_after_eos: ClassVar[bool] = True
    """An attempt that ends on EOS gets its observation and a next turn (the rollout loop reads this)."""

    def __init__(self, config: "Feedback.Config") -> None:
        super().__init__(config)
        self.config: Feedback.Config = config
        self.stop_texts = (config.stop_text,) if config.stop_text is not None else ()

    def start(self, record: Any) -> tuple[str, str]:
        """``(data_source, ground_truth)`` of the episode's record: what the verifier needs."""
        return record.data_source, record.ground_truth

    def step(self, state: tuple[str, str], action: str) -> StepResult:
        from megatron_credit.rewards.math import compute_score_for_source

        c = self.config
        data_source, ground_truth = state
        text = action.rstrip()
        for end in c.end_texts:
            if text.endswith(end):
                text = text[: -len(end)]
        verdict = compute_score_for_source(text, ground_truth, data_source=data_source)
        if verdict.correct or verdict.status != "ok":
            return StepResult(done=True)
        if verdict.extracted is None:
            return StepResult(observation=c.no_answer_text, reward=c.retry_reward)
        return StepResult(observation=c.incorrect_text.format(answer=verdict.extracted), reward=c.retry_reward)
