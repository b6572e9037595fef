"""The reward record and the two registries every verifier goes through.

``REWARD_FNS`` maps a *method* name ("dapo", "math_verify", ...) to a plain callable
``fn(response: str, ground_truth: str) -> RewardRecord``. ``VERIFIER_BY_DATA_SOURCE`` maps a dataset's
``data_source`` column ("math_dapo", "math", "synthetic_arith", ...) to the method that scores it, so
the choice of verifier is made per dataset, once, and never by comparing strings elsewhere.

>>> VERIFIER_BY_DATA_SOURCE.get("math_dapo")
'dapo'
>>> method_for_data_source("nope")
Traceback (most recent call last):
...
ValueError: unknown data source 'nope'; valid names: ['math', 'math_dapo', 'reasoning_gym', 'synthetic_arith', 'synthetic_chain']
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

from megatron_credit.registry import Registry

RewardStatus = Literal["ok", "timeout", "error", "bad_ground_truth"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardRecord:
    """The outcome of scoring one response."""

    score: float
    """Verifier score: +1.0 correct, -1.0 incorrect (DAPO convention); shaping is added later."""
    correct: bool
    """Whether the response's answer matches the ground truth; what dynamic sampling groups on."""
    extracted: str | None
    """The answer string the verifier found in the response (normalised), or None if none was found."""
    status: RewardStatus = "ok"
    """How scoring ended: "ok"; "timeout"/"error" in the verifier workers; "bad_ground_truth" when the
    verifier could not parse the dataset's answer or it is blank (nothing is ever correct against an
    empty answer). All but "ok" score as incorrect and are counted."""


RewardFn = Callable[[str, str], RewardRecord]

REWARD_FNS: Registry[RewardFn] = Registry("reward method")
"""Method name -> ``fn(response, ground_truth) -> RewardRecord``."""

VERIFIER_BY_DATA_SOURCE: Registry[str] = Registry("data source")
"""A record's ``data_source`` -> method name in ``REWARD_FNS``. (``data.source`` is another thing: the
registry of prompt sources, ``data/source_base.py``.)"""

# The DAPO-Math-17K file labels every row "math_dapo"; its answers are integers, and the published
# recipe scores them with the "Answer:" string verifier. MATH-style sets need symbolic equivalence.
VERIFIER_BY_DATA_SOURCE.add("math_dapo", "dapo")
VERIFIER_BY_DATA_SOURCE.add("math", "math_verify")
VERIFIER_BY_DATA_SOURCE.add("synthetic_arith", "synthetic_arith")
VERIFIER_BY_DATA_SOURCE.add("synthetic_chain", "synthetic_chain")
VERIFIER_BY_DATA_SOURCE.add("reasoning_gym", "reasoning_gym")  # its JSON ground truth names the task (rewards/reasoning_gym.py)


def __getattr__(name: str):
    """``DATA_SOURCES``, this registry's old name, for one release, with a warning."""
    if name == "DATA_SOURCES":
        import warnings

        warnings.warn("megatron_credit.rewards.base.DATA_SOURCES is now VERIFIER_BY_DATA_SOURCE; the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return VERIFIER_BY_DATA_SOURCE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def method_for_data_source(data_source: str) -> str:
    """The registered reward method for a dataset's ``data_source`` (ValueError lists valid ones)."""
    return VERIFIER_BY_DATA_SOURCE.get(data_source)


def incorrect(extracted: str | None = None, *, status: RewardStatus = "ok") -> RewardRecord:
    """The record of a response that earns nothing (wrong, unparsable, timed out or failed)."""
    return RewardRecord(score=-1.0, correct=False, extracted=extracted, status=status)


def is_blank(ground_truth: str) -> bool:
    """Whether a ground truth is empty or whitespace: every verifier scores all responses against it as
    incorrect with ``status="bad_ground_truth"`` (datasets refuse such rows at load already).

    >>> is_blank(" \\n"), is_blank("0")
    (True, False)
    """
    return not ground_truth.strip()


def graded(correct: bool, extracted: str | None) -> RewardRecord:
    """The ±1 record of a verdict."""
    return RewardRecord(score=1.0 if correct else -1.0, correct=bool(correct), extracted=extracted)
