"""Verifier of reasoning-gym's procedural tasks (``data/reasoning_gym_tasks.py``): the task's own scorer.

reasoning-gym (an optional dependency: ``pip install 'megatron-credit[reasoning-gym]'``) scores an answer
against the whole dataset entry (its answer and metadata) with the task's ``score_answer``, in [0, 1]. The
source therefore writes the entry into the record's ground truth, as JSON::

    {"task": "basic_arithmetic", "config": {...}, "answer": "-4", "metadata": {...}, "answer_tag": "answer"}

``config`` is what the task was built with (the scorer comes from a dataset built with it, once per
process); ``answer_tag``: the response's answer is its last ``<answer>...</answer>`` (none: no answer, 0),
or, when null, the whole response stripped. reasoning-gym's score ``s`` becomes ``2 s - 1`` (±1 at the
ends, the project's convention) and the response is correct when ``s`` is 1. A ground truth that is not
such JSON, or names a task this reasoning-gym does not have, is ``bad_ground_truth``.

reasoning-gym is imported at the first call, not when this module is.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, incorrect

INSTALL_HINT = "pip install 'megatron-credit[reasoning-gym]' (reasoning-gym==0.1.25)"


def import_reasoning_gym(field: str):
    """The ``reasoning_gym`` module, or one ``ValueError`` naming ``field`` and how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"{field}: reasoning-gym is not installed; {INSTALL_HINT}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def scorer(task: str, config_json: str) -> Callable[[Any, dict], float]:
    """reasoning-gym's ``score_answer`` of ``task`` built with the JSON ``config`` (cached per process)."""
    rg = import_reasoning_gym("reasoning_gym verifier")
    return rg.create_dataset(task, **json.loads(config_json)).score_answer


def extract(response: str, answer_tag: str | None) -> str | None:
    """The answer in ``response``: the last ``<tag>...</tag>`` (stripped; None when there is none), or the
    whole response stripped when ``answer_tag`` is None.

    >>> extract("x <answer> 4 </answer> <answer>5</answer>", "answer"), extract("4", "answer"), extract(" 4 ", None)
    ('5', None, '4')
    """
    if answer_tag is None:
        return response.strip()
    open_, close = f"<{answer_tag}>", f"</{answer_tag}>"
    end = response.rfind(close)
    start = response.rfind(open_, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return response[start + len(open_):end].strip()


@REWARD_FNS.register("reasoning_gym")
def score_reasoning_gym(response: str, ground_truth: str) -> RewardRecord:
    """The task's own score of the response's answer (module docstring)."""
    try:
        gt = json.loads(ground_truth)
        task, config, entry_answer = gt["task"], gt["config"], gt["answer"]
        score_answer = scorer(task, json.dumps(config, sort_keys=True))
    except (ValueError, KeyError, TypeError, AssertionError):
        return incorrect(status="bad_ground_truth")
    answer = extract(response, gt.get("answer_tag"))
    if answer is None:
        return incorrect()
    try:
        s = float(score_answer(answer, {"question": "", "answer": entry_answer, "metadata": gt.get("metadata", {})}))
    except Exception:  # a scorer that cannot read the model's answer: a wrong answer, not a failed verifier
        return incorrect(answer)
    s = min(max(s, 0.0), 1.0)
    return RewardRecord(score=2.0 * s - 1.0, correct=s >= 1.0, extracted=answer)
