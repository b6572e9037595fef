"""What a multi-turn environment is: the contract between the rollout loop and a tool or a game.

A rollout episode alternates model turns and environment steps. The loop generates a model turn until EOS
or one of the environment's :attr:`Environment.stop_texts`, decodes it, and hands the text to
:meth:`Environment.step`; the :class:`StepResult` says what to append to the context (``observation``,
tokens the model did not generate, masked out of the loss), what the turn earned, and whether the episode
is over. The loop, not the environment, owns tokenization, the budget of turns and tokens, and the
final score (the verifier's, plus the turn rewards).

Failures come in two kinds, kept apart on purpose:

- a *tool* failure (a malformed call, an expression that does not evaluate, a call that timed out or was
  killed) is part of the game: the environment answers with an error observation, sets
  ``StepResult.tool_error`` and the episode goes on; the model is expected to learn from it;
- an *environment* failure (``start`` or ``step`` raised, overran the loop's step deadline, or returned
  what the loop cannot use: not a :class:`StepResult`, token ids outside the vocabulary, a reward that is
  not a finite number, a ``done`` that is not a bool) is a bug or an outage:
  the loop counts it in ``env/errors``, ends that trajectory and scores it as incorrect (the verifier's
  incorrect score, -1, plus the turn rewards earned before), so one broken episode never stops training.

Environments are looked up by name in :data:`ENVIRONMENTS` (a recipe's ``env.name``); each declares a
nested keyword-only ``Config`` dataclass of its options (a recipe's ``env.options``), built and checked by
``typed_build`` in :meth:`Environment.from_options`. A plug-in registers its class with
``@ENVIRONMENTS.register("name")`` in any module the run imports; adding one is one file.

This package imports the standard library only (no torch), so the sandbox's worker processes, which
import it, start in a fraction of a second.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from megatron_credit.registry import Registry
from megatron_credit.typed_build import build_dataclass

ENVIRONMENTS: Registry[type["Environment"]] = Registry("env.name")
"""Environment classes by name (a recipe's ``env.name``)."""


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one environment step returns to the rollout loop."""

    observation: str | list[int] = ""
    """What to append to the context before the next model turn: text, which the loop tokenizes, or token
    ids, appended as they are. Empty: nothing (the usual value when ``done``)."""
    reward: float = 0.0
    """This turn's reward, added to the episode's score (the verifier's score comes on top, at the end)."""
    done: bool = False
    """The episode is over: the loop generates no further turn."""
    tool_calls: int = 0
    """Tool calls this step made (for the ``env/tool_calls`` metric)."""
    tool_error: bool = False
    """A tool call failed, was malformed, timed out or was killed, and was answered with an error
    observation. Part of the game, not an environment failure (module docstring)."""


class Environment(abc.ABC):
    """A multi-turn environment (module docstring). One instance serves every episode of a run: what
    belongs to one episode lives in the state :meth:`start` returns, never on ``self``, and :meth:`start`
    and :meth:`step` may be called from several threads at once for different episodes."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        """An environment's options (a recipe's ``env.options``); this one has none."""

    stop_texts: ClassVar[tuple[str, ...]] = ()
    """Texts that end a model turn besides EOS (the end of a tool call). Each must encode to exactly one
    token id, which the rollout loop checks at start-up. An instance may set its own (from its config)."""

    def __init__(self, config: "Environment.Config") -> None:
        self.config = config

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]] = None, where: str = "env.options") -> "Environment":
        """This environment built from a recipe's options mapping (None: all defaults); an unknown key or a
        wrong type is one ``ValueError`` naming the field as ``{where}.<field>``."""
        return cls(build_dataclass(cls.Config, dict(options or {}), where))

    def start(self, record: Any) -> Any:
        """The state of a new episode on ``record`` (a ``megatron_credit.data.records.PromptRecord``: its
        ``ground_truth``, ``messages``, ``extra_info``, ``uid``; the environments sit below the data, so the
        type is named here, not imported); passed back to every :meth:`step` of that episode. None here: no per-episode state."""
        return None

    @abc.abstractmethod
    def step(self, state: Any, action: str) -> StepResult:
        """Answer one model turn. ``action`` is the turn's decoded text, including the stop text it ended on
        (one of :attr:`stop_texts`), or the whole answer when it ended on EOS.

        May raise: the caller counts a step that raises (or overruns its deadline) in ``env/errors``, ends
        that trajectory and scores it as incorrect (-1 plus the turn rewards earned before). A failed tool
        call is not such a failure: answer it with ``StepResult(tool_error=True)``.
        """

    def close(self) -> None:
        """Release what the environment holds (worker processes, connections). Called once, at the end."""

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_environment(name: str, options: Optional[Mapping[str, Any]] = None) -> Environment:
    """The environment registered as ``name`` (a recipe's ``env.name``), built from ``options``
    (``env.options``). An unknown name is one ``ValueError`` listing the registered ones; the built-in
    environments are registered by the package (``env/__init__.py``), which any import of this module runs."""
    return ENVIRONMENTS.get(name).from_options(options)
