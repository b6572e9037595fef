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
- ``"reasoning_gym"``: reasoning-gym's own scorer of each task (``rewards/reasoning_gym.py``).

Each math-verify parse and comparison has ``MATH_VERIFY_TIMEOUT_S`` (default 5 s, for in-process calls
from a main thread), through our own ``SIGALRM`` timer (:func:`_deadline`), which only works in a
process's main thread. It is not math-verify's one ``signal.alarm``: an alarm whose exception is raised
inside a garbage-collection callback is printed and dropped by the interpreter, and the parse then runs on
to its end, however long, and reads as an ordinary answer; ours fires again every
:data:`REFIRE_S` s until the call ends. A verifier worker sets the timeout to None, because there hostile
input (a parse that never returns) is handled by ``rewards/verifier_workers.py``, which runs verifiers in
processes it can kill. Outside a main thread set it to None and call ``compute_score`` only on trusted strings.
A call that hits the timeout returns ``status="timeout"`` (math-verify itself would log a warning and
report "no answer", which would read as an ordinary wrong answer); other math-verify parse or
comparison errors still mean "no answer" / "not equal".

>>> compute_score("... so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5", method="math_verify").correct
True
>>> compute_score("Answer: \\\\frac{1}{2}", "0.5", method="dapo").correct
False
"""
from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading

from megatron_credit.rewards import arith as _arith  # noqa: F401  (registers "synthetic_arith", "synthetic_chain")
from megatron_credit.rewards import dapo as _dapo  # noqa: F401  (registers "dapo")
from megatron_credit.rewards import reasoning_gym as _reasoning_gym  # noqa: F401  (registers "reasoning_gym")
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


MATH_VERIFY_TIMEOUT_S: float | None = 5
"""Each math-verify parse's and comparison's timeout in seconds (:func:`_deadline`); None disables it (a
verifier worker does). It only applies in a main thread: elsewhere ``signal`` cannot install the handler, so
calls from other threads run without it."""

REFIRE_S = 0.05
"""After the first, the timer fires again this often until the guarded call ends."""


@contextlib.contextmanager
def _deadline(seconds):
    """Raise math-verify's ``TimeoutException`` in the guarded block once it has run ``seconds`` s (None: no
    limit), and again every :data:`REFIRE_S` s if one is swallowed (raised in a finalizer or a weakref
    callback, where the interpreter only prints it). Main thread only, like any signal handler."""
    if seconds is None:
        yield
        return
    from math_verify.errors import TimeoutException

    def on_alarm(signum, frame):
        raise TimeoutException(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
    try:
        yield
    finally:
        while True:  # a firing while it disarms is dropped: the block has ended
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
                break
            except TimeoutException:
                continue


class _OurTimeout(logging.Filter):
    """math-verify warns once that its timeout is off and the caller must provide one: :func:`_deadline` is it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_OurTimeout())

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
            with _deadline(limit):
                return parse(text, parsing_timeout=None, raise_on_error=True)
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
        with _deadline(limit):
            same = bool(verify(gold, pred, timeout_seconds=None, raise_on_error=True))
    except Exception:  # noqa: BLE001  (a comparison error means "not equal", as without raise_on_error)
        same = False
    return graded(same, str(pred[-1]))
