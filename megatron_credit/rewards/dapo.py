"""The DAPO "Answer:" verifier: the published semantics, rewritten.

Same behaviour as verl's ``reward_score/math_dapo.py`` (itself the Minerva / lm-eval-harness
normaliser): only the last 300 characters of the response are read; the answer is the rest of the
line after the last ``Answer:`` (case-insensitive); prediction and ground truth both go through the
Minerva normalisation (last ``=`` side, unit words and TeX decorations removed, ``\\boxed{}`` /
``\\text{}`` unwrapped, ``\\fracab`` expanded, thousands separators dropped) and must then be equal as
strings. Score +1 / -1.

Departure from the published code: a response without any ``Answer:`` line reports ``extracted=None``
instead of the sentinel string ``"[INVALID]"`` (the verdict is the same: incorrect).

This is string matching, so it has known false negatives (``0.5`` vs ``\\frac{1}{2}``, ``x=3`` in the
ground truth, ``\\dfrac``); datasets that need symbolic equivalence use the "math_verify" method.

>>> score_dapo("so the total is 12.\\nAnswer: 1,234 dollars", "1234")
RewardRecord(score=1.0, correct=True, extracted='1234', status='ok')
>>> score_dapo("Answer: \\\\frac{1}{2}", "0.5").correct
False
"""
from __future__ import annotations

import re

from megatron_credit.rewards.base import REWARD_FNS, RewardRecord, graded, incorrect

# The longest answer line in MATH-500 is 159 characters; the published verifier reads 300.
TAIL_CHARS = 300
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva normalisation tables (Lewkowycz et al. 2022, appendix D), in the published order: the
# substitutions run before the removals, and "an "/"a " go first, so they also strip article words.
SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` with balanced braces, or None.

    >>> last_boxed_only_string("a \\\\boxed{1} b \\\\boxed{\\\\frac{1}{2}} c")
    '\\\\boxed{\\\\frac{1}{2}}'
    >>> last_boxed_only_string("\\\\boxed{unclosed") is None
    True
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """``\\boxed{x}`` -> ``x``."""
    prefix = "\\boxed{"
    if not (boxed.startswith(prefix) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{}} expression: {boxed!r}")
    return boxed[len(prefix) : -1]


def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation of a final answer string.

    >>> normalize_final_answer("x = \\\\text{10 feet}")
    '10'
    >>> normalize_final_answer("\\\\frac12")
    '\\\\frac{1}{2}'
    """
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    # Keep only the first $...$ span; unwrap \text{}, \textbf{}, \overline{}, \boxed{}.
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    # Shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}.
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer_line(response: str) -> str | None:
    """The text after the last ``Answer:`` in the last 300 characters (un-normalised), or None."""
    matches = ANSWER_PATTERN.findall(response[-TAIL_CHARS:])
    return matches[-1] if matches else None


@REWARD_FNS.register("dapo")
def score_dapo(response: str, ground_truth: str) -> RewardRecord:
    """DAPO verifier: normalised last ``Answer:`` line == normalised ground truth -> +1, else -1.

    A ground truth that normalises to nothing (``""``, ``"dollars"``, ``"$"``) matches no response: it
    would otherwise equal the normalisation of any unit word (``Answer: dollars``).

    >>> score_dapo("Answer: dollars", "")
    RewardRecord(score=-1.0, correct=False, extracted='', status='bad_ground_truth')
    """
    line = extract_answer_line(response)
    pred = None if line is None else normalize_final_answer(line)
    gold = normalize_final_answer(ground_truth)
    if not gold:
        return incorrect(pred, status="bad_ground_truth")
    if pred is None:
        return graded(False, None)
    return graded(pred == gold, pred)
