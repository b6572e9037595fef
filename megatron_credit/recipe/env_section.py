"""The recipe's ``env`` section: the environment a multi-turn rollout plays and the loop's bounds on it
(docs/multi_turn.md). Checked as the other sections are (``recipe/sections.py``): one ``ValueError`` naming
the field."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from megatron_credit.typed_build import NonNegativeInt, PositiveFloat, PositiveInt


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Multi-turn rollouts: an environment the policy acts in turn by turn, e.g. a tool it calls
    (``megatron_credit.env``, ``rollout/multi_turn.py``; docs/multi_turn.md)."""

    name: str = "none"
    """``none`` (single-turn: one response per prompt), ``calculator``, ``feedback`` (a wrong answer gets
    the verifier's verdict and another try; any ``data.source``), ``openenv`` (an environment written for
    OpenEnv, ``pip install openenv-core==0.3.0``), or one that a ``--plugin`` file registers with
    ``@ENVIRONMENTS.register``."""
    max_turns: PositiveInt = 4
    """Model turns per trajectory at most (each at most ``rollout.max_response_len`` tokens)."""
    max_total_tokens: PositiveInt = 512
    """Response tokens of a whole trajectory at most: the policy's turns and the observations between them."""
    step_timeout_s: PositiveFloat = 30.0
    """An environment step that takes longer is counted in ``env/errors`` and ends its trajectory."""
    step_threads: PositiveInt = 8
    """Threads that run the environment's ``start`` and ``step`` calls, those of different trajectories at
    once (a tool that waits on I/O wants more; each thread is idle otherwise)."""
    lockstep: bool = False
    """Generate each later turn of the draw's trajectories together, once every step of the turn before
    returned. Off (the default), a trajectory's next turn is generated as soon as its own step returns
    (the trajectories ready at once share one engine call): the draw takes about its slowest trajectory's
    time, not the sum of each turn's slowest step. The sampled tokens are the seeds' either way; on, each
    engine call holds the same trajectories whatever order the steps end in, so the engine's log-probs
    also repeat bit for bit (off they agree to float rounding: an engine's batch changes its arithmetic)."""
    max_failed_iterations: NonNegativeInt = 3
    """Stop the run, in one line naming the environment and its reason, once the environment failed
    (raised, overran ``step_timeout_s`` or returned what the loop cannot use) on every trajectory of this
    many iterations in a row: every trajectory is then scored by the abort rule and the run learns nothing
    (0: never stop)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The environment's own options (its ``Config`` dataclass); unknown keys fail."""

    def __post_init__(self) -> None:
        if self.enabled:
            from megatron_credit.env import ENVIRONMENTS

            if self.name not in ENVIRONMENTS:
                raise ValueError(f"env.name: unknown environment {self.name!r}; valid names: "
                                 f"{['none', *ENVIRONMENTS.names()]} (one that a plugin file registers needs "
                                 "--plugin FILE)")
            self.config()
        elif self.options:
            raise ValueError(f"env.options {sorted(self.options)} given without an environment: set env.name")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def config(self):
        """The environment's ``Config`` with :attr:`options` (one ``ValueError`` naming ``env.options.<field>``)."""
        from megatron_credit.env import ENVIRONMENTS
        from megatron_credit.typed_build import build_dataclass

        return build_dataclass(ENVIRONMENTS.get(self.name).Config, dict(self.options), "env.options")
