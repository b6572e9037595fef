"""Verifier of the synthetic arithmetic task (``data/synthetic.py``).

The task's chat template ends the prompt with the answer prefix ``Answer:`` so that a randomly
initialised model only has to produce the number (a model that must first discover the literal
string "Answer:" by chance never sees a reward). This verifier therefore reads ``ANSWER_PREFIX +
response`` with the DAPO rule (the last ``Answer:`` within the last 300 characters wins, so a model
that writes its own ``Answer: N`` later is scored on that), and compares the *leading integer* after
it with the ground truth as integers: ``" 7 and more"`` answers 7. Two departures from DAPO, both so
that a model that has learnt the sum but not yet when to stop is not scored -1: the leading integer is
compared instead of the whole rest of the line, and the last ``Answer:`` counts even when it is not the
first on its line.

>>> score_arith(" 12", "12")
RewardRecord(score=1.0, correct=True, extracted='12', status='ok')
>>> score_arith("7+5 Answer: 13", "12").extracted
'13'
>>> score_arith("x", "12").extracted is None
True
"""
from __future__ import annotations

import re

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, graded
from megatron_credit.rewards.dapo import TAIL_CHARS

ANSWER_PREFIX = "Answer:"
_ANSWER = re.compile(r"(?i)Answer\s*:")
_LEADING_INT = re.compile(r"\s*(-?\d+)")


@REWARD_FNS.register("synthetic_arith")
def score_arith(response: str, ground_truth: str) -> RewardRecord:
    """+1 if the leading integer of the last ``Answer:`` line equals the integer ground truth."""
    tail = (ANSWER_PREFIX + response)[-TAIL_CHARS:]
    anchors = list(_ANSWER.finditer(tail))
    match = _LEADING_INT.match(tail, anchors[-1].end()) if anchors else None
    if match is None:
        return graded(False, None)
    pred = match.group(1)
    return graded(int(pred) == int(ground_truth), pred)
