"""Environments written against OpenEnv's own API (``openenv-core``), which the ``openenv`` adapter tests load by
import path (``tests.env.openenv_targets:NAME``). Imports the library: import it only where it is installed.

``GuessNumber`` is a guess-the-number game in text whose words are token ids (the tiny engine's text,
``tests/rollout/test_multi_turn.py::Tok``): a turn's first number is the guess; the observation's
``verdict`` is ``91`` (too low) or ``92`` (too high); its rubric scores each guess (``HIT`` for the target,
``MISS`` otherwise); the game ends on the target or after ``max_guesses`` guesses.
"""
from __future__ import annotations

from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric, TrajectoryRubric

HIT, MISS = 1.0, -0.25
LOW, HIGH = "91", "92"
BUILT: list["GuessNumber"] = []
"""Every instance built, in order (the tests count the ones closed)."""


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    verdict: str = ""
    guesses: int = 0


class GuessState(State):
    target: int = 0
    won: bool = False


class PerGuess(Rubric):
    def forward(self, action: Any, observation: Any) -> float:
        return HIT if observation.metadata.get("hit") else MISS


class AtTheEnd(TrajectoryRubric):
    """0 until the game ends; then 1 for a win, 0 for a loss (OpenEnv's delayed reward)."""

    def score_trajectory(self, trajectory):
        return 1.0 if trajectory[-1][1].metadata.get("hit") else 0.0

    def compute_step_rewards(self):
        return [self.score_trajectory(self._trajectory)] * len(self._trajectory)


class GuessNumber(Environment[GuessAction, GuessObservation, GuessState]):
    def __init__(self, max_guesses: int = 3, rubric: Optional[Rubric] = None):
        super().__init__(rubric=rubric if rubric is not None else PerGuess())
        self.max_guesses = max_guesses
        self._state = GuessState()
        self.closed = False
        BUILT.append(self)

    def reset(self, seed=None, episode_id=None, target: str = "0", **kwargs) -> GuessObservation:
        self._reset_rubric()
        self._state = GuessState(episode_id=episode_id, target=int(target))
        return GuessObservation(verdict="start")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        words = action.message.split()
        guess = int(words[0]) if words and words[0].isdigit() else -1
        self._state.step_count += 1
        hit = guess == self._state.target
        obs = GuessObservation(verdict="" if hit else LOW if guess < self._state.target else HIGH,
                               guesses=self._state.step_count, metadata={"hit": hit},
                               done=hit or self._state.step_count >= self.max_guesses)
        obs.reward = self._apply_rubric(action, obs)
        return obs

    @property
    def state(self) -> GuessState:
        return self._state

    def close(self) -> None:
        self.closed = True


def guess_at_the_end(max_guesses: int = 3) -> GuessNumber:
    """The same game whose reward comes only when it ends (a trajectory rubric)."""
    return GuessNumber(max_guesses=max_guesses, rubric=AtTheEnd())


class Broken(GuessNumber):
    """Its second step fails as ``how`` says: ``raise``, ``none`` (returns None), ``nan`` (a NaN reward),
    ``done`` (a ``done`` that is not a bool, built past pydantic's checks)."""

    def __init__(self, how: str = "raise", **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def step(self, action, timeout_s=None, **kwargs):
        if self._state.step_count == 0:
            return super().step(action)
        if self.how == "raise":
            raise RuntimeError("the game server is down")
        if self.how == "none":
            return None
        if self.how == "nan":
            return GuessObservation(verdict=LOW, reward=float("nan"))
        return GuessObservation.model_construct(verdict=LOW, reward=0.0, done="yes", metadata={}, guesses=0)


SHARED = GuessNumber()


def shared() -> GuessNumber:
    """A factory that gives every episode the same instance (refused: an instance holds one episode)."""
    return SHARED


class OneThread(GuessNumber):
    REQUIRES_SINGLE_THREAD_EXECUTOR = True
