"""Table-driven tests of the math verifiers, the data-source mapping and reward shaping.

The table pins the DAPO string verifier to the published semantics *including its known false
negatives* (rows marked "FN"), and shows that the math-verify method scores those rows correctly.
"""
import time

import pytest
import torch

from megatron_credit.rewards import dapo
from megatron_credit.rewards.base import VERIFIER_BY_DATA_SOURCE, REWARD_FNS, RewardRecord, method_for_data_source
from megatron_credit.rewards.math import compute_score, compute_score_for_source
from megatron_credit.rewards.shaping import (
    ShapingConfig,
    length_penalty,
    overlong_penalty,
    reasoning_well_formed,
    shape_rewards,
)

B = "\\boxed"
LONG_PAD = "x" * 400  # pushes text out of DAPO's 300-character window

# (response, ground_truth, method, expected correct)
CASES = [
    # --- DAPO "Answer:" semantics -------------------------------------------------------------
    ("Let me think.\nAnswer: 42", "42", "dapo", True),
    ("Answer: 42", "43", "dapo", False),
    ("answer: 42", "42", "dapo", True),  # case-insensitive
    ("ANSWER :   42", "42", "dapo", True),  # spaces around the colon
    ("Answer: 1\nmore work\nAnswer: 2", "2", "dapo", True),  # last Answer line wins
    ("Answer: 1\nmore work\nAnswer: 2", "1", "dapo", False),
    ("The answer is 42.", "42", "dapo", False),  # no "Answer:" line at all
    ("Answer: 42\n" + LONG_PAD, "42", "dapo", False),  # outside the last 300 chars
    (LONG_PAD + "\nAnswer: 42", "42", "dapo", True),
    ("Answer: 1,234", "1234", "dapo", True),  # thousands separator
    ("Answer: $42$", "42", "dapo", True),
    ("Answer: \\boxed{42}", "42", "dapo", True),
    ("Answer: \\text{42}", "42", "dapo", True),
    ("Answer: 42 dollars", "42", "dapo", True),  # Minerva removes listed units
    ("Answer: 10 cm", "10", "dapo", True),
    ("Answer: 90^\\circ", "90", "dapo", True),
    ("Answer: x = 5", "5", "dapo", True),  # last side of "="
    ("Answer: \\frac12", "\\frac{1}{2}", "dapo", True),  # shorthand \frac expanded
    ("Answer: \\sqrt2", "\\sqrt{2}", "dapo", True),
    ("Answer: 3 \\text{ and } 4", "3,4", "dapo", True),  # "\\text{and}" -> ","
    ("Answer: 34", "3,4", "dapo", True),  # a published false POSITIVE: "3,4" normalises to "34"
    ("Answer: -7", "-7", "dapo", True),
    ("Answer: 42", "\\boxed{42}", "dapo", True),  # ground-truth \boxed is unwrapped
    ("Answer: 3.0", "3", "dapo", False),
    # --- known false negatives of string matching (FN): DAPO says no, math_verify says yes -----
    ("Answer: 0.5", "\\frac{1}{2}", "dapo", False),  # FN
    ("Answer: 0.5", "\\frac{1}{2}", "math_verify", True),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", "dapo", False),  # FN
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", "math_verify", True),
    ("Answer: 12 apples", "12", "dapo", False),  # FN: "apples" is not a Minerva unit
    ("Answer: 12 apples", "12", "math_verify", True),
    ("Answer: 42. I double-checked this twice.", "42", "dapo", False),  # FN: text after the answer
    ("Answer: 42. I double-checked this twice.", "42", "math_verify", True),
    (f"So {B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}.", "\\frac{\\sqrt{3}}{2}", "dapo", False),  # FN: boxed only
    (f"So {B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}.", "\\frac{\\sqrt{3}}{2}", "math_verify", True),  # nested
    ("Answer: 2/4", "\\frac{1}{2}", "dapo", False),  # FN
    ("Answer: 2/4", "\\frac{1}{2}", "math_verify", True),
    ("Answer: [1, 3)", "[1,3)", "dapo", True),
    ("Answer: \\{3, 2, 1\\}", "\\{1,2,3\\}", "dapo", False),  # FN: set order
    ("Answer: \\{3, 2, 1\\}", "\\{1,2,3\\}", "math_verify", True),
    ("Answer: 50\\%", "50", "dapo", False),  # FN
    ("Answer: 50\\%", "50", "math_verify", True),
    # --- math-verify: boxed, fractions, decimals, intervals, sets, expressions ---------------------
    (f"The answer is {B}{{\\frac{{1}}{{2}}}}", "0.5", "math_verify", True),
    (f"The answer is {B}{{\\frac{{1}}{{2}}}}", "0.6", "math_verify", False),
    (f"thus {B}{{12}}. Also, 7 is prime.", "12", "math_verify", True),  # text after the box
    (f"first {B}{{3}} then {B}{{5}}", "5", "math_verify", False),  # all boxes form one set answer
    (f"first {B}{{3}} then {B}{{5}}", "\\{3,5\\}", "math_verify", True),
    (f"{B}{{[1, 3)}}", "[1,3)", "math_verify", True),
    (f"{B}{{(1, 3]}}", "[1,3)", "math_verify", False),  # interval ends differ
    (f"{B}{{(-\\infty, 2]}}", "(-\\infty,2]", "math_verify", True),
    (f"{B}{{\\{{1,2,3\\}}}}", "\\{3,2,1\\}", "math_verify", True),
    (f"{B}{{\\{{1,2\\}}}}", "\\{1,2,3\\}", "math_verify", False),
    (f"{B}{{2\\pi}}", "2\\pi", "math_verify", True),
    (f"{B}{{\\pi \\cdot 2}}", "2\\pi", "math_verify", True),
    (f"{B}{{6.28}}", "2\\pi", "math_verify", False),
    (f"{B}{{\\sqrt{{8}}}}", "2\\sqrt{2}", "math_verify", True),
    (f"{B}{{x^2+2x+1}}", "(x+1)^2", "math_verify", True),
    (f"{B}{{1{{,}}000}}", "1000", "math_verify", True),
    ("The final answer is $\\boxed{-3}$", "-3", "math_verify", True),
    ("The final answer is $\\boxed{-3}$", "3", "math_verify", False),
    ("$x = 3$", "3", "math_verify", True),
    ("Answer: 10 cm", "10", "math_verify", True),
    ("Answer: $\\frac{1}{2}$", "0.5", "math_verify", True),  # a delimited answer line
    ("Answer: 3", "\\boxed{3}", "math_verify", True),
    ("I do not know.", "5", "math_verify", False),
    ("", "5", "math_verify", False),
    (f"{B}{{3}}", "4", "math_verify", False),
    (f"{B}{{0.333333}}", "\\frac{1}{3}", "math_verify", True),  # 6-digit rounding
    (f"{B}{{0.33}}", "\\frac{1}{3}", "math_verify", False),
    (f"{B}{{\\text{{(B)}}}}", "B", "math_verify", True),
    (f"{B}{{unclosed", "5", "math_verify", False),
    # --- synthetic arithmetic: the prompt ends with "Answer:" -------------------------------------
    (" 12", "12", "synthetic_arith", True),
    ("12", "12", "synthetic_arith", True),
    (" 12 and more tokens", "12", "synthetic_arith", True),  # leading integer counts
    (" 13", "12", "synthetic_arith", False),
    (" 120", "12", "synthetic_arith", False),
    (" -4", "-4", "synthetic_arith", True),
    (" x12", "12", "synthetic_arith", False),
    (" 7 wait Answer: 12", "12", "synthetic_arith", True),  # a later Answer: wins
    ("", "12", "synthetic_arith", False),
    (" 12 Answer:", "12", "synthetic_arith", True),  # a trailing empty Answer: does not override
    (" 12 Answer: x", "12", "synthetic_arith", True),  # only anchors followed by an integer count
    (" 12" + LONG_PAD, "12", "synthetic_arith", True),  # the implicit prefix is never pushed out
    (" 12 Answer: 13" + LONG_PAD, "12", "synthetic_arith", True),  # no anchor in the window: leading int
    (" 7 wait Answer: 12 Answer:", "12", "synthetic_arith", True),
    # --- review rows, pinned to current behaviour; FN/FP = known false negative/positive ---------
    ("Answer: 42.", "42", "dapo", False),  # FN of DAPO: the trailing period stays in the string
    ("Answer: 42.", "42", "math_verify", True),
    ("**Answer:** 42", "42", "dapo", False),  # FN of DAPO: "** 42" after the colon
    ("**Answer:** 42", "42", "math_verify", True),
    ("Answer: 5 m", "5", "dapo", False),  # FN of DAPO: "m" is not a Minerva unit word
    ("Answer: 5 m", "5", "math_verify", True),
    ("Answer: \\tfrac{1}{2}", "\\frac{1}{2}", "dapo", False),  # FN of DAPO: \tfrac is not normalised
    ("Answer: \\tfrac{1}{2}", "\\frac{1}{2}", "math_verify", True),
    ("Answer: \\frac{-1}{2}", "-\\frac{1}{2}", "dapo", False),  # FN of DAPO: sign placement
    ("Answer: \\frac{-1}{2}", "-\\frac{1}{2}", "math_verify", True),
    ("Answer: 2", "2.0", "dapo", False),  # FN of DAPO (and why datasets must not store "2.0")
    ("Answer: 2", "2.0", "math_verify", True),
    ("Answer: 2.0", "2", "math_verify", True),
    ("Answer: 1\\,234", "1234", "dapo", False),  # FN of DAPO: "\\," thin space is not removed
    ("Answer: 1\\,234", "1234", "math_verify", False),  # FN of math_verify too: read as 1 and 234
    (f"I first got {B}{{3}} but restated: {B}{{5}}", "5", "dapo", False),  # FN: no Answer: line
    (f"I first got {B}{{3}} but restated: {B}{{5}}", "5", "math_verify", True),  # (vs "first..then" above)
    (f"{B}{{5}}, restated: {B}{{5}}", "5", "math_verify", True),
    ("Answer: 1,2", "12", "dapo", True),  # FP of DAPO: "," is dropped as a thousands separator
    ("Answer: 1,2", "12", "math_verify", False),
    # --- math-verify reading prose on the Answer: line (once false negatives, now fixed) --------
    ("Answer: **42**", "42", "math_verify", True),
    ("Answer: 42, because 6 times 7 is 42", "42", "math_verify", True),
    ("Answer: it is 12", "12", "math_verify", True),
    ("Answer: 3 (B)", "3", "math_verify", True),
    ("Answer: x=5, so 5", "5", "math_verify", True),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}", "math_verify", True),
    ("Answer: x+1", "x+1", "math_verify", True),  # a symbolic answer keeps the LaTeX reading
    ("Answer: 5 and 7", "5", "math_verify", False),  # two answers are a set, not 5
    # --- an escaped dollar in the ground truth is a currency sign, not a delimiter --------------
    ("Answer: 18.90", "\\$18.90", "math_verify", True),
    ("Answer: \\$18.90", "\\$18.90", "math_verify", True),
    ("Answer: 18.91", "\\$18.90", "math_verify", False),
]


def test_table_has_enough_cases():
    assert len(CASES) >= 60
    assert {m for _, _, m, _ in CASES} == {"dapo", "math_verify", "synthetic_arith"}


@pytest.mark.parametrize("response,ground_truth,method,expected", CASES)
def test_verifier_table(response, ground_truth, method, expected, monkeypatch):
    from megatron_credit.rewards import math as reward_math

    # The table checks verdicts, not speed: on a loaded machine math-verify's 5 s alarm can fire, and a
    # timeout is reported as status "timeout" (test_bad_input_data), not as a silent wrong answer.
    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", 60)
    record = compute_score(response, ground_truth, method=method)
    assert isinstance(record, RewardRecord)
    assert record.correct is expected
    assert record.score == (1.0 if expected else -1.0)
    assert record.status == "ok"
    if expected:
        assert record.extracted is not None


@pytest.mark.parametrize(
    "response,ground_truth,extracted",
    [
        ("Answer: 1,234 dollars", "1234", "1234"),
        ("Answer: \\boxed{\\frac12}", "x", "\\frac{1}{2}"),
        ("no answer here", "1", None),
        ("Answer: x = \\text{10 feet}", "10", "10"),
    ],
)
def test_dapo_extracted(response, ground_truth, extracted):
    assert compute_score(response, ground_truth, method="dapo").extracted == extracted


def test_math_verify_extracted_is_the_matched_answer():
    rec = compute_score(f"so {B}{{\\frac{{1}}{{2}}}}", "0.5", method="math_verify")
    assert rec.extracted == "\\frac{1}{2}"
    assert compute_score("nothing", "0.5", method="math_verify").extracted is None


def test_unparsable_ground_truth_is_counted_not_raised():
    rec = compute_score("Answer: 5", "", method="math_verify")
    assert rec.status == "bad_ground_truth" and not rec.correct and rec.score == -1.0
    assert compute_score("Answer: 18.90", "\\$18.90", method="math_verify").status == "ok"


def test_math_verify_timeout_setting(monkeypatch):
    import threading

    import math_verify

    from megatron_credit.rewards import math as reward_math

    assert reward_math.MATH_VERIFY_TIMEOUT_S == 5  # on by default in-process
    seen, theirs = [], []
    real_parse, real_deadline = math_verify.parse, reward_math._deadline

    def spy(text, **kwargs):
        theirs.append(kwargs.get("parsing_timeout"))
        return real_parse(text, **kwargs)

    def deadline(seconds):
        seen.append(seconds)
        return real_deadline(seconds)

    monkeypatch.setattr(math_verify, "parse", spy)
    monkeypatch.setattr(reward_math, "_deadline", deadline)
    assert compute_score("Answer: 5", "5", method="math_verify").correct
    assert seen and set(seen) == {5}
    assert set(theirs) == {None}  # math-verify's own one-shot alarm is never used: ours fires again
    seen.clear()
    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", None)  # what a verifier worker does
    assert compute_score("Answer: 5", "5", method="math_verify").correct
    assert set(seen) == {None}
    # Outside a main thread a signal handler cannot be installed: the call still works, without a timeout.
    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", 5)
    seen.clear()
    out = []
    t = threading.Thread(target=lambda: out.append(compute_score("Answer: 5", "5", method="math_verify")))
    t.start()
    t.join()
    assert out[0].correct and set(seen) == {None}


def test_last_boxed_only_string_nested_braces():
    s = "x \\boxed{1} y \\boxed{\\frac{a^{2}}{b_{1}}} z"
    assert dapo.last_boxed_only_string(s) == "\\boxed{\\frac{a^{2}}{b_{1}}}"
    assert dapo.remove_boxed(dapo.last_boxed_only_string(s)) == "\\frac{a^{2}}{b_{1}}"
    with pytest.raises(ValueError, match="boxed"):
        dapo.remove_boxed("\\fbox{1}")


def test_data_source_selects_method():
    assert method_for_data_source("math_dapo") == "dapo"
    assert method_for_data_source("math") == "math_verify"
    assert method_for_data_source("synthetic_arith") == "synthetic_arith"
    # The same response is a false negative under the DAPO source and correct under "math".
    assert not compute_score_for_source("Answer: 0.5", "\\frac{1}{2}", data_source="math_dapo").correct
    assert compute_score_for_source("Answer: 0.5", "\\frac{1}{2}", data_source="math").correct
    with pytest.raises(ValueError, match="valid names"):
        compute_score("Answer: 1", "1", method="no_such_method")
    with pytest.raises(ValueError, match="already registered"):
        VERIFIER_BY_DATA_SOURCE.add("math", "dapo")
    assert {"dapo", "math_verify", "synthetic_arith"} <= set(REWARD_FNS.names())


# ----------------------------------------------------------------------------------------------
# Shaping: loop references written from the formulas.


def _overlong_ref(length, lmax, lbuf, factor):
    if lbuf == 0:
        return 0.0
    return max(-factor, min(0.0, -(length - (lmax - lbuf)) / lbuf * factor))


def test_overlong_penalty_matches_formula():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 140, (200,), generator=g)
    for lmax, lbuf, factor in [(128, 32, 1.0), (128, 128, 0.5), (100, 1, 2.0), (64, 0, 1.0)]:
        got = overlong_penalty(lengths, max_response_len=lmax, buffer_len=lbuf, factor=factor)
        want = torch.tensor([_overlong_ref(int(n), lmax, lbuf, factor) for n in lengths], dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        assert (got <= 0).all()


def test_shape_rewards_components():
    cfg = ShapingConfig(
        max_response_len=20, overlong_buffer_len=4, overlong_penalty_factor=1.0, format_penalty=0.5,
        require_reasoning_tags=True, length_coef=0.1,
    )
    responses = ["<think>a</think>Answer: 1", "no tags", "<think>a</think>Answer: 2", "<think>x</think>y"]
    scores = torch.tensor([1.0, 1.0, -1.0, 1.0])
    correct = scores > 0
    lengths = torch.tensor([10, 18, 20, 20])
    total, metrics = shape_rewards(scores, correct, lengths, responses, config=cfg)
    want = []
    for r, s, c, n in zip(responses, scores.tolist(), correct.tolist(), lengths.tolist()):
        ok = reasoning_well_formed(r, open_tag="<think>", close_tag="</think>", required=True)
        v = s + _overlong_ref(n, 20, 4, 1.0) + (0.0 if ok else -0.5)
        if c and ok:
            v -= 0.1 * min(n, 20) / 20
        want.append(v)
    torch.testing.assert_close(total.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.isclose(metrics["reward/malformed_frac"], torch.tensor(0.25))
    # Length penalty only for correct & well formed; shaping never touches accuracy.
    all_formed = torch.ones(4, dtype=torch.bool)
    assert length_penalty(lengths, ~correct, all_formed, max_response_len=20, coef=1.0)[0] == 0


@pytest.mark.parametrize(
    "response,required,ok",
    [
        ("<think>r</think>a", True, True),
        ("r</think>a", True, True),  # the template opened the block
        ("<think>r", True, False),
        ("a", True, False),
        ("a", False, True),
        ("</think>r<think>", False, False),
        ("<think>a</think><think>b</think>", False, False),
        ("<think><think>a</think>", False, False),
    ],
)
def test_reasoning_well_formed(response, required, ok):
    assert reasoning_well_formed(response, open_tag="<think>", close_tag="</think>", required=required) is ok


def test_shaping_config_validates():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        ShapingConfig(max_response_len=10, overlong_buffer_len=11)
    with pytest.raises(ValueError, match="format_penalty"):
        ShapingConfig(max_response_len=10, format_penalty=-1.0)


# ------------------------------------------------------------------- mutation killers
def test_math_verify_an_unreadable_ground_truth_is_flagged_with_the_answer_kept():
    # A ground truth math-verify cannot read ("$$", an empty box) scores every response as incorrect with
    # status bad_ground_truth (counted in reward/bad_ground_truths), keeping the response's answer for the logs.
    from megatron_credit.rewards.base import RewardRecord
    from megatron_credit.rewards.math import score_math_verify

    for gt in ("$$", "\\boxed{}"):
        assert score_math_verify("so \\boxed{5}", gt) == RewardRecord(score=-1.0, correct=False, extracted="5",
                                                                     status="bad_ground_truth")
    assert score_math_verify("nothing to read", "$$") == RewardRecord(score=-1.0, correct=False, extracted=None,
                                                                     status="bad_ground_truth")
    assert score_math_verify("no numbers here", "5") == RewardRecord(score=-1.0, correct=False, extracted=None,
                                                                    status="ok")
    assert score_math_verify("Answer: 5 and 6", "6").extracted == "5, 6"  # the last parse: every answer read


def test_dapo_normalisation_strips_markup_around_the_answer():
    from megatron_credit.rewards.dapo import last_boxed_only_string, normalize_final_answer

    assert last_boxed_only_string("\\boxed{5}") == "\\boxed{5}"  # a box at the very start of the text
    assert normalize_final_answer("the $5$ apples") == "5"  # the math between the first pair of $
    assert normalize_final_answer("\\textbf{5}") == "5" and normalize_final_answer("\\overline{5}") == "5"


def test_math_verify_reads_the_box_over_an_answer_line_and_through_emphasis():
    from megatron_credit.rewards.math import score_math_verify

    assert score_math_verify("Answer: 4\nso \\boxed{5}", "5").correct  # a boxed answer wins over the line
    assert score_math_verify("Answer: **5**", "5").correct


@pytest.mark.parametrize("response,ground_truth,correct,extracted", [
    # The answer line read as LaTeX math ("$...$"): emphasis markers are removed, not replaced.
    ("Answer: **x+1**", "x+1", True, "x+1"),
    ("Answer: __x__ + 1", "x+1", True, "x + 1"),
    # Prose read as math gains symbols the ground truth lacks: the line is re-read as text ...
    ("Answer: the value is $x+1$", "x+1", True, "x+1"),
    ("Answer: y = x+1", "x+1", True, "y = x+1"),
    ("Answer: x is 3, y is 4", "x", False, "4"),
    # ... and when the line as text holds no answer, the whole response is read.
    ("The total is 12.\nAnswer: the total above", "12", True, "12"),
    ("x was 3.\nAnswer: the answer is above", "3", True, "3"),
])
def test_math_verify_answer_line_fallbacks(response, ground_truth, correct, extracted, monkeypatch):
    from megatron_credit.rewards import math as reward_math

    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", 60)  # verdicts, not speed (see the table test)
    rec = reward_math.score_math_verify(response, ground_truth)
    assert (rec.correct, rec.extracted, rec.status) == (correct, extracted, "ok")


def test_math_verify_bad_ground_truth_keeps_the_answer_as_written():
    from megatron_credit.rewards.math import score_math_verify

    # math-verify parses to [expression, the string it matched]: the log keeps the string, not sympy's form.
    rec = score_math_verify("so \\boxed{\\frac{1}{2}}", "$$")
    assert (rec.status, rec.extracted) == ("bad_ground_truth", "\\frac{1}{2}")


def test_math_verify_a_ground_truth_sympy_cannot_compare_is_never_matched(monkeypatch):
    # 1/0 is sympy's zoo: comparing anything with it raises inside math-verify, which must read as
    # "not equal" (a dataset row with a division by zero rewards nobody), never as correct or an error.
    from megatron_credit.rewards import math as reward_math

    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", 60)
    for response in ("Answer: 5", "\\boxed{\\frac{1}{0}}", "\\boxed{\\infty}"):
        rec = reward_math.score_math_verify(response, "\\frac{1}{0}")
        assert (rec.correct, rec.score, rec.status) == (False, -1.0, "ok"), response


# method="thread": the verifier's SIGALRM timer (set and cleared around each parse) cancels
# pytest-timeout's SIGALRM timer, so a comparison left without math-verify's limit would hang the signal
# method; the thread method ends the process instead (a failure).
@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("response,ground_truth", [
    ("\\boxed{9!!!!!}", "7"),  # parsed at once; the comparison evaluates a tower of factorials
    # the parse itself takes seconds: 3,000 factors took 1.6 s without a limit, close enough to the 1 s limit
    # that warm caches (the full suite's earlier tests) let it finish in time; 12,000 never do
    ("\\boxed{" + "(x+1)*" * 12000 + "1}", "5"),
])
def test_math_verify_real_timeouts_are_reported(response, ground_truth, monkeypatch):
    # math-verify's own alarm, not a stub: with a 1 s limit these never finish in time, and the record says
    # "timeout" (math-verify alone would log a warning and answer "not equal" / "no answer").
    from megatron_credit.rewards import math as reward_math

    monkeypatch.setattr(reward_math, "MATH_VERIFY_TIMEOUT_S", 1)
    rec = reward_math.score_math_verify(response, ground_truth)
    assert (rec.correct, rec.score, rec.status) == (False, -1.0, "timeout")


def test_a_timeout_swallowed_once_fires_again():
    # An alarm's exception raised inside a garbage-collection callback is printed and dropped by the
    # interpreter (the full suite saw one in torch._dynamo's weak dictionary during a parse, which then ran
    # to its end and read as "ok"). The timer fires again until the guarded call ends; afterwards it is
    # disarmed and the previous handler is back.
    import signal

    from math_verify.errors import TimeoutException

    from megatron_credit.rewards import math as reward_math

    before = signal.getsignal(signal.SIGALRM)
    t0, dropped = time.monotonic(), []
    with pytest.raises(TimeoutException):
        with reward_math._deadline(0.2):
            while time.monotonic() - t0 < 10:
                try:
                    while time.monotonic() - t0 < 10:
                        pass
                except TimeoutException:
                    if dropped:
                        raise
                    dropped.append(time.monotonic() - t0)  # what the interpreter does in a finalizer
    # without a second firing the loop would run its 10 s out and end without raising
    assert dropped[0] >= 0.2 and time.monotonic() - t0 < 10
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_old_name_of_the_data_source_registry_still_works_with_a_warning():
    from megatron_credit.rewards import base

    with pytest.warns(DeprecationWarning, match="DATA_SOURCES is now VERIFIER_BY_DATA_SOURCE"):
        old = base.DATA_SOURCES
    assert old is VERIFIER_BY_DATA_SOURCE and old.get("math_dapo") == "dapo"
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        base.NO_SUCH_NAME


@pytest.mark.parametrize("old, new", [("RewardPool", "VerifierWorkers"), ("RewardPoolConfig", "VerifierWorkersConfig"),
                                      ("RewardItem", "RewardItem"), ("IMPORT_GRACE_S", "IMPORT_GRACE_S")])
def test_the_old_module_of_the_verifier_workers_still_works_with_a_warning(old, new):
    from megatron_credit.rewards import pool, verifier_workers

    with pytest.warns(DeprecationWarning) as caught:
        got = getattr(pool, old)
    assert got is getattr(verifier_workers, new)
    assert [str(w.message) for w in caught] == [
        f"megatron_credit.rewards.pool.{old} is now megatron_credit.rewards.verifier_workers.{new}; "
        "the old name goes in the next release"]
    assert caught[0].filename == __file__  # points at the caller's line


def test_the_old_import_of_the_verifier_workers_still_works_and_other_names_do_not():
    from megatron_credit.rewards import pool
    from megatron_credit.rewards.verifier_workers import VerifierWorkers, VerifierWorkersConfig

    with pytest.warns(DeprecationWarning, match="RewardPoolConfig is now .*VerifierWorkersConfig"):
        from megatron_credit.rewards.pool import RewardPoolConfig
    assert RewardPoolConfig is VerifierWorkersConfig and RewardPoolConfig(num_workers=3).num_workers == 3
    with pytest.warns(DeprecationWarning, match="RewardPool is now .*VerifierWorkers;"):
        from megatron_credit.rewards.pool import RewardPool
    assert RewardPool is VerifierWorkers
    with pytest.raises(AttributeError, match="no attribute 'VerifierWorkers'"):
        pool.VerifierWorkers  # only the old names live there
