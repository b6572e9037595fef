"""The calculator environment: the model may end a turn with a call such as ``<call>12*(3+4)</call>`` and
gets ``<result>84</result>`` appended before its next turn; a turn without a call is its answer.

A turn is read from its end, since ``call_close`` is a stop text (the turn ends right after it):

- it ends with ``call_close`` (trailing whitespace aside) and has a ``call_open`` before it: a call; the
  expression is what lies between the last ``call_open`` and the end marker, evaluated by
  ``calc_eval.evaluate`` in a :class:`~megatron_credit.env.sandbox.Sandbox` (a hung or greedy evaluation
  costs one worker, never the rollout). The value comes back as ``{result_open}{value}{result_close}``
  with ``call_reward``; a failure (not arithmetic, division by zero, too long, too large, timed out,
  killed) as ``{result_open}{error_text}{result_close}`` with ``tool_error`` and no reward;
- it has a ``call_open`` but does not end with ``call_close`` (the turn ran out of tokens inside a
  call): a malformed call, answered with the same error observation;
- otherwise the model answered: the episode ends (``done``), and the verifier scores the answer.

The episode carries no state of its own (every call is independent), and the sandbox is started at the
first call, so building the environment (e.g. for a dry run) starts no process.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from megatron_credit.env.base import ENVIRONMENTS, Environment, StepResult
from megatron_credit.env.sandbox import Sandbox


@ENVIRONMENTS.register("calculator")
class Calculator(Environment):
    """Arithmetic tool calls (module docstring). Thread-safe: steps of several episodes may run at once."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Environment.Config):
        """The calculator's options (a recipe's ``env.options``)."""

        call_open: str = "<call>"
        """Text that opens a tool call."""
        call_close: str = "</call>"
        """Text that closes a tool call; a stop text, so it must encode to one token id."""
        result_open: str = "<result>"
        """Text before the value in the observation."""
        result_close: str = "</result>"
        """Text after the value in the observation."""
        error_text: str = "error"
        """What the observation says between the result markers for a failed or malformed call."""
        timeout_s: float = 2.0
        """Wall seconds one evaluation may take before its sandbox worker is killed."""
        memory_limit_mb: int = 256
        """Address-space limit of each sandbox worker, in MiB (>= 64: a worker's interpreter takes about 20)."""
        workers: int = 2
        """Sandbox worker processes (calls from concurrent episodes run in parallel up to this many)."""
        max_expression_chars: int = 64
        """Longest expression evaluated; a longer one is a failed call (never sent to the sandbox)."""
        call_reward: float = 0.0
        """Reward of each turn whose call returned a value (a failed or malformed call earns none)."""

        def __post_init__(self) -> None:
            for name in ("call_open", "call_close"):
                if not getattr(self, name):
                    raise ValueError(f"env.options.{name} must be a non-empty string, got {getattr(self, name)!r}")
            if self.call_open == self.call_close:
                raise ValueError(f"env.options.call_close must differ from env.options.call_open, both are "
                                 f"{self.call_open!r}")
            if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
                raise ValueError(f"env.options.timeout_s must be > 0, got {self.timeout_s!r}")
            for name, low in (("memory_limit_mb", 64), ("workers", 1), ("max_expression_chars", 1)):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise ValueError(f"env.options.{name} must be an int >= {low}, got {value!r}")
            if not (isinstance(self.call_reward, (int, float)) and math.isfinite(self.call_reward)):
                raise ValueError(f"env.options.call_reward must be a finite number, got {self.call_reward!r}")

    evaluator: ClassVar[str] = "megatron_credit.env.calc_eval:evaluate"
    """The sandboxed function that evaluates an expression (``"module:qualname"``, torch-free)."""

    def __init__(self, config: "Calculator.Config") -> None:
        super().__init__(config)
        self.config: Calculator.Config = config
        self.stop_texts = (config.call_close,)
        self._sandbox: Optional[Sandbox] = None
        self._lock = threading.Lock()
        self._closed = False

    def step(self, state: Any, action: str) -> StepResult:
        """Answer one turn (module docstring). Raises RuntimeError only when the sandbox cannot start or
        the environment is closed."""
        c = self.config
        body = action.rstrip()
        if body.endswith(c.call_close) and c.call_open in body[: -len(c.call_close)]:
            expression = body[: -len(c.call_close)].rsplit(c.call_open, 1)[1].strip()
            if len(expression) > c.max_expression_chars:
                return self._failed()
            ok, value = self._sandbox_for_calls().run(self.evaluator, expression)
            if not ok:
                return self._failed()
            return StepResult(observation=f"{c.result_open}{value}{c.result_close}", reward=c.call_reward,
                              tool_calls=1)
        if c.call_open in action:
            return self._failed()
        return StepResult(done=True)

    def close(self) -> None:
        """Stop the sandbox's workers; a later :meth:`step` with a call raises RuntimeError."""
        with self._lock:
            self._closed = True
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()

    @property
    def sandbox(self) -> Optional[Sandbox]:
        """The sandbox (its ``kills`` and ``restarts`` counters), or None before the first call."""
        return self._sandbox

    def _failed(self) -> StepResult:
        """The answer to a failed or malformed call."""
        c = self.config
        return StepResult(observation=f"{c.result_open}{c.error_text}{c.result_close}", tool_calls=1,
                          tool_error=True)

    def _sandbox_for_calls(self) -> Sandbox:
        """The sandbox, started at the first call (once, whichever thread gets there first)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the calculator environment is closed")
            if self._sandbox is None:
                c = self.config
                self._sandbox = Sandbox(workers=c.workers, timeout_s=c.timeout_s,
                                        memory_limit_bytes=c.memory_limit_mb << 20)
            return self._sandbox
