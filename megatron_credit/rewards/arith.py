"""Verifier of the synthetic arithmetic task (``data/synthetic.py``).

The task's chat template ends the prompt with the answer prefix ``Answer:`` so that a randomly
initialised model only has to produce the number (a model that must first discover the literal
string "Answer:" by chance never sees a reward). This verifier therefore reads the response as if
``Answer:`` preceded it. Like DAPO, a later ``Answer: N`` within the last 300 characters wins (a model
that writes its own answer line is scored on that), but only an ``Answer:`` *followed by an integer*
counts, so a trailing empty ``Answer:`` does not override the answer; if the window has none, the
response's leading integer is the answer (the implicit prefix is never pushed out of the window by a
long tail). The leading integer is compared with the ground truth as integers: ``" 7 and more"``
answers 7. Both departures from DAPO are so that a model that has learnt the sum but not yet when to
stop is not scored -1.

>>> score_arith(" 12", "12")
RewardRecord(score=1.0, correct=True, extracted='12', status='ok')
>>> score_arith("7+5 Answer: 13", "12").extracted
'13'
>>> score_arith("x", "12").extracted is None
True

``score_chain`` scores the chain task (``data/chain.py``): the response writes every running sum and
only its *last* integer is the answer (a truncated chain ends on an intermediate sum and fails).

>>> score_chain(" 2 11 15 20", "20").correct, score_chain(" 2 11 15", "20").extracted
(True, '15')
"""
from __future__ import annotations

import re

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, graded, incorrect
from megatron_credit.rewards.dapo import TAIL_CHARS

ANSWER_PREFIX = "Answer:"
_ANSWER_INT = re.compile(r"(?i)Answer\s*:\s*(-?\d+)")
_LEADING_INT = re.compile(r"\s*(-?\d+)")
_ANY_INT = re.compile(r"-?\d+")


@REWARD_FNS.register("synthetic_arith")
def score_arith(response: str, ground_truth: str) -> RewardRecord:
    """+1 if the answer (last ``Answer: N`` in the tail, else the leading integer) equals the ground truth.

    >>> score_arith(" 12 Answer:", "12").correct, score_arith(" 12" + "." * 400, "12").correct
    (True, True)
    >>> score_arith(" 12", " ").status  # a ground truth that is not an integer: never correct
    'bad_ground_truth'
    """
    try:
        gold = int(ground_truth)
    except ValueError:
        return incorrect(status="bad_ground_truth")
    anchors = list(_ANSWER_INT.finditer(response[-TAIL_CHARS:]))
    if anchors:
        pred = anchors[-1].group(1)
    else:
        match = _LEADING_INT.match(response)
        if match is None:
            return graded(False, None)
        pred = match.group(1)
    return graded(int(pred) == gold, pred)


@REWARD_FNS.register("synthetic_chain")
def score_chain(response: str, ground_truth: str) -> RewardRecord:
    """+1 if the last integer of the response equals the ground truth (the chain's final sum).

    Only the final answer is rewarded: the intermediate sums earn nothing by themselves, which is what
    makes the task a credit-assignment problem.

    >>> score_chain(" 3 8 10", "10"), score_chain(" 3 8 11", "10").correct, score_chain("", "10").extracted
    (RewardRecord(score=1.0, correct=True, extracted='10', status='ok'), False, None)
    >>> score_chain(" 3", "x").status
    'bad_ground_truth'
    """
    try:
        gold = int(ground_truth)
    except ValueError:
        return incorrect(status="bad_ground_truth")
    numbers = _ANY_INT.findall(response[-TAIL_CHARS:])
    if not numbers:
        return graded(False, None)
    return graded(int(numbers[-1]) == gold, numbers[-1])
