"""CompPO's phase controller: stable / warning / strong / hard-stop (the paper's Table 14 and App. C.2).

A pure state machine over each RL step's logged metrics. It only *chooses* a phase; the trainer applies
the phase's :class:`PhaseSettings` (KL coefficient, clip, learning rates, clips, epochs) to the loss and
the optimizers, and logs the phase every step.

Each monitored signal requests a phase (0 = stable ... 3 = hard_stop) when it crosses that phase's
threshold in :class:`PhaseThresholds`; the step's *request* is the highest phase any signal asks for.

- **Trigger event**: the request is above the current phase. After ``escalate_after`` consecutive trigger
  steps the controller moves up ONE phase (a sustained hard-stop request from stable takes three moves).
- **Clear step**: the request is below the current phase (nothing asks for more than the phase below).
  After ``deescalate_after`` consecutive clear steps it moves down one phase.
- Any other step (the request equals the current phase) resets both counters; so does every move.

Signals (trainer metric names, README's metrics table); a key missing from a step is not checked, and a
non-finite value never requests anything:

- ``actor/entropy``: its EMA (decay ``entropy_ema``, started at the first value) *below* a level;
- ``actor/clipfrac_high + actor/clipfrac_low`` (the clip fraction), ``actor/ppo_kl``, ``actor/kl_ref``
  (the KL loss), ``actor/grad_norm`` (warning / strong only): at or above a level;
- ``val/accuracy`` (on the steps that have it): its drop from the best of earlier validations;
- entropy drop (strong / hard-stop only): the highest entropy EMA so far minus the current one, checked
  only while the same step's clip fraction or PPO KL is at or above its warning threshold;
- ``response/truncated_frac`` (the response-clip ratio; hard-stop only).

The paper gives the entropy-drop thresholds without saying from what the drop is measured; we measure
it from the highest entropy EMA seen, as the validation drop is measured from the best accuracy.

>>> c = PhaseController()
>>> [c.step({"actor/ppo_kl": 0.1}) for _ in range(3)]
['stable', 'warning', 'warning']
>>> c.settings.clip
0.16
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Optional

PHASES = ("stable", "warning", "strong", "hard_stop")


@dataclass(frozen=True, kw_only=True)
class PhaseSettings:
    """What a phase sets (the paper's Table 14)."""

    kl_coef: float
    """Coefficient of the KL-to-reference loss."""
    clip: float
    """Policy clip range."""
    actor_lr: float
    """Actor learning rate."""
    value_clip: float
    """Value-loss clip."""
    critic_lr_mult: float
    """Multiplier on the critic's learning rate."""
    adv_clip: float
    """Advantages are clipped to ``[-adv_clip, adv_clip]``."""
    grad_clip: float
    """Gradient-norm clip of the actor and of the critic."""
    epochs: int
    """Actor epochs over each batch."""


PHASE_TABLE: dict[str, PhaseSettings] = {
    "stable": PhaseSettings(kl_coef=0.0020, clip=0.20, actor_lr=1e-6, value_clip=0.5, critic_lr_mult=1.0,
                            adv_clip=5.0, grad_clip=1.0, epochs=2),
    "warning": PhaseSettings(kl_coef=0.0035, clip=0.16, actor_lr=7e-7, value_clip=0.4, critic_lr_mult=0.9,
                             adv_clip=4.0, grad_clip=0.8, epochs=2),
    "strong": PhaseSettings(kl_coef=0.0045, clip=0.14, actor_lr=5e-7, value_clip=0.3, critic_lr_mult=0.7,
                            adv_clip=3.5, grad_clip=0.7, epochs=2),
    "hard_stop": PhaseSettings(kl_coef=0.0070, clip=0.09, actor_lr=2e-7, value_clip=0.2, critic_lr_mult=0.5,
                               adv_clip=2.5, grad_clip=0.5, epochs=1),
}

Levels = tuple[Optional[float], Optional[float], Optional[float]]


@dataclass(frozen=True, kw_only=True)
class PhaseThresholds:
    """Request thresholds, each ``(warning, strong, hard_stop)``; ``None``: that phase is never requested
    by this signal. Lists (from YAML) are accepted and stored as tuples."""

    entropy_below: Levels = (8.0, 7.5, 6.5)
    """Entropy EMA strictly below these."""
    clipfrac: Levels = (0.14, 0.18, 0.25)
    """``actor/clipfrac_high + actor/clipfrac_low`` at or above these."""
    ppo_kl: Levels = (0.08, 0.12, 0.22)
    """``actor/ppo_kl`` at or above these."""
    kl_loss: Levels = (2.85, 3.20, 4.00)
    """``actor/kl_ref`` at or above these."""
    grad_norm: Levels = (40.0, 80.0, None)
    """``actor/grad_norm`` at or above these."""
    val_drop: Levels = (0.04, 0.08, 0.20)
    """Drop of ``val/accuracy`` from its running best at or above these."""
    entropy_drop: Levels = (None, 1.5, 3.0)
    """Entropy-EMA drop from its highest value at or above these, while clip fraction or PPO KL is at or
    above its warning threshold."""
    truncated_frac: Levels = (None, None, 0.65)
    """``response/truncated_frac`` at or above these."""

    def __post_init__(self) -> None:
        for f in fields(self):
            levels = tuple(getattr(self, f.name))
            if len(levels) != 3:
                raise ValueError(f"phase thresholds.{f.name} needs 3 levels (warning, strong, hard_stop), "
                                 f"got {levels}")
            given = [float(x) for x in levels if x is not None]
            ordered = sorted(given, reverse=(f.name == "entropy_below"))
            if given != ordered:
                direction = "non-increasing" if f.name == "entropy_below" else "non-decreasing"
                raise ValueError(f"phase thresholds.{f.name} must be {direction}, got {levels}")
            object.__setattr__(self, f.name, tuple(None if x is None else float(x) for x in levels))


REACH_TOL = 1e-9
"""A threshold is reached up to this much, so a validation drop of 0.50 - 0.46 (0.03999...98 in floating
point) counts as the 0.04 it is."""


def _level_at_or_above(value: Optional[float], levels: Levels) -> int:
    """Highest phase index (1..3) whose threshold ``value`` reaches; 0 if none, or if ``value`` is None/NaN."""
    if value is None or not math.isfinite(value):
        return 0
    return max((i + 1 for i, th in enumerate(levels) if th is not None and value >= th - REACH_TOL), default=0)


def _level_below(value: Optional[float], levels: Levels) -> int:
    if value is None or not math.isfinite(value):
        return 0
    return max((i + 1 for i, th in enumerate(levels) if th is not None and value < th), default=0)


def _get(metrics: Mapping[str, float], key: str) -> Optional[float]:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class PhaseController:
    """The stable / warning / strong / hard-stop state machine (see the module docstring)."""

    def __init__(self, thresholds: PhaseThresholds = PhaseThresholds(), *, entropy_ema: float = 0.9,
                 escalate_after: int = 2, deescalate_after: int = 5):
        if not 0.0 <= entropy_ema < 1.0:
            raise ValueError(f"phase entropy_ema must be in [0, 1), got {entropy_ema}")
        for name, value in (("escalate_after", escalate_after), ("deescalate_after", deescalate_after)):
            if value < 1:
                raise ValueError(f"phase {name} must be >= 1, got {value}")
        self.thresholds = thresholds
        self.entropy_decay = entropy_ema
        self.escalate_after = escalate_after
        self.deescalate_after = deescalate_after
        self._index = 0
        self._events = 0
        self._clear = 0
        self._entropy_ema: Optional[float] = None
        self._entropy_ema_max: Optional[float] = None
        self._val_best: Optional[float] = None
        self.last_requests: dict[str, int] = {}
        """The phase index each signal requested on the last step (for logs and tests)."""

    @property
    def phase(self) -> str:
        return PHASES[self._index]

    @property
    def settings(self) -> PhaseSettings:
        return PHASE_TABLE[self.phase]

    def requests(self, metrics: Mapping[str, float]) -> dict[str, int]:
        """Update the entropy EMA and the validation best with ``metrics``; return each signal's request."""
        th = self.thresholds
        entropy = _get(metrics, "actor/entropy")
        if entropy is not None:
            self._entropy_ema = entropy if self._entropy_ema is None else (
                self.entropy_decay * self._entropy_ema + (1.0 - self.entropy_decay) * entropy)
            self._entropy_ema_max = (self._entropy_ema if self._entropy_ema_max is None
                                     else max(self._entropy_ema_max, self._entropy_ema))
        high, low = _get(metrics, "actor/clipfrac_high"), _get(metrics, "actor/clipfrac_low")
        clipfrac = None if high is None and low is None else (high or 0.0) + (low or 0.0)
        ppo_kl = _get(metrics, "actor/ppo_kl")
        val_drop = None
        accuracy = _get(metrics, "val/accuracy")
        if accuracy is not None:
            if self._val_best is not None:
                val_drop = self._val_best - accuracy
            self._val_best = accuracy if self._val_best is None else max(self._val_best, accuracy)
        in_warning = (_level_at_or_above(clipfrac, th.clipfrac[:1]) > 0
                      or _level_at_or_above(ppo_kl, th.ppo_kl[:1]) > 0)
        entropy_drop = (self._entropy_ema_max - self._entropy_ema
                        if in_warning and entropy is not None else None)
        return {
            "entropy": _level_below(self._entropy_ema if entropy is not None else None, th.entropy_below),
            "clipfrac": _level_at_or_above(clipfrac, th.clipfrac),
            "ppo_kl": _level_at_or_above(ppo_kl, th.ppo_kl),
            "kl_loss": _level_at_or_above(_get(metrics, "actor/kl_ref"), th.kl_loss),
            "grad_norm": _level_at_or_above(_get(metrics, "actor/grad_norm"), th.grad_norm),
            "val_drop": _level_at_or_above(val_drop, th.val_drop),
            "entropy_drop": _level_at_or_above(entropy_drop, th.entropy_drop),
            "truncated_frac": _level_at_or_above(_get(metrics, "response/truncated_frac"), th.truncated_frac),
        }

    def step(self, metrics: Mapping[str, float]) -> str:
        """Read one RL step's metrics, move at most one phase, return the phase for the next step."""
        self.last_requests = self.requests(metrics)
        requested = max(self.last_requests.values())
        if requested > self._index:  # trigger event
            self._events, self._clear = self._events + 1, 0
            if self._events >= self.escalate_after:
                self._index, self._events = self._index + 1, 0
        elif requested < self._index:  # clear step
            self._events, self._clear = 0, self._clear + 1
            if self._clear >= self.deescalate_after:
                self._index, self._clear = self._index - 1, 0
        else:
            self._events = self._clear = 0
        return self.phase

    def state_dict(self) -> dict:
        return {"phase": self.phase, "events": self._events, "clear": self._clear,
                "entropy_ema": self._entropy_ema, "entropy_ema_max": self._entropy_ema_max,
                "val_best": self._val_best}

    def load_state_dict(self, state: Mapping) -> None:
        if state["phase"] not in PHASES:
            raise ValueError(f"phase controller checkpoint: phase={state['phase']!r}, valid values {list(PHASES)}")
        self._index = PHASES.index(state["phase"])
        self._events, self._clear = int(state["events"]), int(state["clear"])
        self._entropy_ema, self._entropy_ema_max = state["entropy_ema"], state["entropy_ema_max"]
        self._val_best = state["val_best"]
