"""Math answer verification: one entry point, ``compute_score``, over the registered methods.

Methods (``REWARD_FNS``):

- ``"dapo"``: the DAPO "Answer:" string verifier (``rewards/dapo.py``).
- ``"math_verify"``: symbolic equivalence through HF ``math-verify``: ``\\boxed{}`` (nested braces),
  fractions vs decimals, intervals, sets, units and text around the answer. The ground truth is
  wrapped in ``\\boxed{}`` unless it already carries ``\\boxed`` or ``$`` delimiters, so a bare
  ``"1/2"`` or ``"[1,3)"`` is parsed as the answer itself and not searched for an anchor. A response
  with a ``\\boxed{}`` is parsed whole (math-verify gives boxes priority; several boxes are read as one
  set answer). A response without one but with a DAPO ``Answer:`` line is parsed from that line as
  LaTeX math, because math-verify does not find undelimited LaTeX after "Answer:" (``Answer:
  \\dfrac{1}{2}`` would otherwise parse to nothing); if the line gives nothing, the whole response.
- ``"synthetic_arith"``: the synthetic arithmetic task (``rewards/arith.py``).

``math-verify`` guards itself with ``signal.alarm``, which only works in a process's main thread and
would fire into whatever else that process runs. We call it with its timeouts disabled; hostile input
(a parse that never returns) is handled by ``rewards/pool.py``, which runs verifiers in processes it can
kill. Call ``compute_score`` directly only on trusted strings (tests, evaluation of known outputs).

>>> compute_score("... so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5", method="math_verify").correct
True
>>> compute_score("Answer: \\\\frac{1}{2}", "0.5", method="dapo").correct
False
"""
from __future__ import annotations

from megatron_credit.rewards import arith as _arith  # noqa: F401  (registers "synthetic_arith")
from megatron_credit.rewards import dapo as _dapo  # noqa: F401  (registers "dapo")
from megatron_credit.rewards.base import (
    REWARD_FNS,
    RewardRecord,
    graded,
    method_for_data_source,
)


def compute_score(response: str, ground_truth: str, *, method: str) -> RewardRecord:
    """Score one response against its ground truth with the named method (see module docstring)."""
    return REWARD_FNS.get(method)(response, ground_truth)


def compute_score_for_source(response: str, ground_truth: str, *, data_source: str) -> RewardRecord:
    """Score with the method registered for a dataset's ``data_source``."""
    return compute_score(response, ground_truth, method=method_for_data_source(data_source))


def _as_gold_latex(ground_truth: str) -> str:
    """Give math-verify a ground truth it parses as one answer, not as text to search."""
    gt = ground_truth.strip()
    if "\\boxed" in gt or "$" in gt:
        return gt
    return "\\boxed{" + gt + "}"


@REWARD_FNS.register("math_verify")
def score_math_verify(response: str, ground_truth: str) -> RewardRecord:
    """Symbolic equivalence of the response's final answer and the ground truth (±1).

    ``extracted`` is the answer string math-verify matched in the response (None if it found none).
    A ground truth math-verify cannot parse makes every response incorrect, never an exception.
    """
    from math_verify import parse, verify  # lazy: pulls sympy (~1 s of import)

    gold = parse(_as_gold_latex(ground_truth), parsing_timeout=None)
    line = None if "\\boxed" in response else _dapo.extract_answer_line(response)
    pred = parse(f"${line.strip()}$", parsing_timeout=None) if line is not None else []
    if not pred:
        pred = parse(response, parsing_timeout=None)
    if not pred:
        return graded(False, None)
    extracted = str(pred[-1])
    if not gold:
        return graded(False, extracted)
    return graded(bool(verify(gold, pred, timeout_seconds=None)), extracted)
