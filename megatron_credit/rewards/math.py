"""Math answer verification: one entry point, ``compute_score``, over the registered methods.

Methods (``REWARD_FNS``):

- ``"dapo"``: the DAPO "Answer:" string verifier (``rewards/dapo.py``).
- ``"math_verify"``: symbolic equivalence through HF ``math-verify``: ``\\boxed{}`` (nested braces),
  fractions vs decimals, intervals, sets, units and text around the answer. The ground truth is
  wrapped in ``\\boxed{}`` unless it already carries ``\\boxed`` or an unescaped ``$`` delimiter
  (``\\$18.90`` is a dollar sign, not a delimiter), so a bare ``"1/2"`` or ``"[1,3)"`` is parsed as
  the answer itself and not searched for an anchor. A ground truth math-verify cannot parse scores
  every response incorrect with ``status="bad_ground_truth"`` (counted in the metrics). A response
  with a ``\\boxed{}`` is parsed whole (math-verify gives boxes priority; several boxes are read as one
  set answer). A response without one but with a DAPO ``Answer:`` line is parsed from that line
  (markdown ``**``/``__`` emphasis removed) as LaTeX math, because math-verify does not find
  undelimited LaTeX after "Answer:" (``Answer: \\dfrac{1}{2}`` would otherwise parse to nothing). Read
  as math, prose becomes a product of symbols (``it is 12`` is ``12 i^2 s t``), so when that parse has
  free symbols the ground truth lacks, the line is parsed as text instead, then the whole response;
  if the line gives nothing, the whole response.
- ``"synthetic_arith"``, ``"synthetic_chain"``: the synthetic arithmetic tasks (``rewards/arith.py``).

``math-verify`` guards itself with ``signal.alarm``, which only works in a process's main thread and
would fire into whatever else that process runs. Its timeout is ``MATH_VERIFY_TIMEOUT_S`` (default
5 s, for in-process calls from a main thread); the pool worker sets it to None, because there hostile
input (a parse that never returns) is handled by ``rewards/pool.py``, which runs verifiers in processes
it can kill. Outside a main thread set it to None and call ``compute_score`` only on trusted strings.
A call that hits the timeout returns ``status="timeout"`` (math-verify itself would log a warning and
report "no answer", which would read as an ordinary wrong answer); other math-verify parse or
comparison errors still mean "no answer" / "not equal".

>>> compute_score("... so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5", method="math_verify").correct
True
>>> compute_score("Answer: \\\\frac{1}{2}", "0.5", method="dapo").correct
False
"""
from __future__ import annotations

import re
import threading

from megatron_credit.rewards import arith as _arith  # noqa: F401  (registers "synthetic_arith", "synthetic_chain")
from megatron_credit.rewards import dapo as _dapo  # noqa: F401  (registers "dapo")
from megatron_credit.rewards.base import (
    REWARD_FNS,
    RewardRecord,
    graded,
    incorrect,
    is_blank,
    method_for_data_source,
)


def compute_score(response: str, ground_truth: str, *, method: str) -> RewardRecord:
    """Score one response against its ground truth with the named method (see module docstring)."""
    return REWARD_FNS.get(method)(response, ground_truth)


def compute_score_for_source(response: str, ground_truth: str, *, data_source: str) -> RewardRecord:
    """Score with the method registered for a dataset's ``data_source``."""
    return compute_score(response, ground_truth, method=method_for_data_source(data_source))


MATH_VERIFY_TIMEOUT_S: int | None = 5
"""math-verify's own parse/verify timeout in whole seconds (``signal.alarm`` takes an int); None
disables it (the pool worker does). It only applies in a main thread: elsewhere ``signal`` cannot
install the handler, so calls from other threads run without it."""

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_EMPHASIS = re.compile(r"\*\*|__")


def _as_gold_latex(ground_truth: str) -> str:
    """Give math-verify a ground truth it parses as one answer, not as text to search.

    >>> _as_gold_latex("\\\\$18.90"), _as_gold_latex("$x$")
    ('\\\\boxed{\\\\$18.90}', '$x$')
    """
    gt = ground_truth.strip()
    if "\\boxed" in gt or _UNESCAPED_DOLLAR.search(gt):
        return gt
    return "\\boxed{" + gt + "}"


def _free_symbols(parsed: list) -> set[str]:
    """Names of the free symbols of math-verify's parsed objects (strings have none)."""
    names: set[str] = set()
    for obj in parsed:
        names.update(str(sym) for sym in getattr(obj, "free_symbols", ()) or ())
    return names


@REWARD_FNS.register("math_verify")
def score_math_verify(response: str, ground_truth: str) -> RewardRecord:
    """Symbolic equivalence of the response's final answer and the ground truth (±1).

    ``extracted`` is the answer string math-verify matched in the response (None if it found none).
    A ground truth math-verify cannot parse makes every response incorrect, never an exception.
    """
    if is_blank(ground_truth):  # "\\boxed{}" must not parse into something a response can match
        return incorrect(status="bad_ground_truth")
    from math_verify.errors import TimeoutException  # lazy: pulls sympy (~1 s of import)

    try:
        return _score_math_verify(response, ground_truth)
    except TimeoutException:  # a BaseException: raised by math-verify's signal.alarm guard
        return incorrect(status="timeout")


def _score_math_verify(response: str, ground_truth: str) -> RewardRecord:
    """:func:`score_math_verify` without its timeout handling (raises math-verify's TimeoutException)."""
    from math_verify import parse, verify

    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None

    def _parse(text: str) -> list:
        try:  # raise_on_error: a timeout raises instead of reading as "nothing parsed"
            return parse(text, parsing_timeout=limit, raise_on_error=True)
        except Exception:  # noqa: BLE001  (a parse error means no answer, as without raise_on_error)
            return []

    gold = _parse(_as_gold_latex(ground_truth))
    line = None if "\\boxed" in response else _dapo.extract_answer_line(response)
    pred: list = []
    if line is not None:
        line = _EMPHASIS.sub("", line).strip()
        pred = _parse(f"${line}$")
        if pred and gold and _free_symbols(pred) - _free_symbols(gold):
            pred = _parse(line) or _parse(response) or pred  # prose read as a product of symbols
    if not pred:
        pred = _parse(response)
    if not gold:
        return incorrect(str(pred[-1]) if pred else None, status="bad_ground_truth")
    if not pred:
        return graded(False, None)
    try:
        same = bool(verify(gold, pred, timeout_seconds=limit, raise_on_error=True))
    except Exception:  # noqa: BLE001  (a comparison error means "not equal", as without raise_on_error)
        same = False
    return graded(same, str(pred[-1]))
