"""The calculator environment: calls are evaluated like Python arithmetic, every failed or malformed call
is an error observation (never an exception), an answer ends the episode, bad options are one line naming
the field, and plug-in environments resolve through the same registry."""
from __future__ import annotations

import dataclasses
import time

import pytest

from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.env import ENVIRONMENTS, Environment, StepResult, build_environment
from megatron_credit.env.calc_eval import evaluate, format_number
from megatron_credit.env.calculator import Calculator

EXPRESSIONS = ["1 + 2", "(1 + 2) * 3", "7 / 2", "10 / 4 * 2", "2 ** 10", "-2 ** 3", "2 ** -2", "17 // 5",
               "-17 // 5", "-3 % 5", "5.5 % 2", "0.1 + 0.2", "+4 - -4", "3 * (2 + (4 - 1)) / 5", "2 ** 64",
               "1e300 * 10", "1_000 * 3"]
ERROR = StepResult(observation="<result>?</result>", tool_calls=1, tool_error=True)
RECORD = PromptRecord(uid="t-0", data_source="calc", messages=(ChatMessage(role="user", content="1+2?"),),
                      ground_truth="3")


@pytest.fixture(scope="module")
def calc():
    env = build_environment("calculator", {"error_text": "?", "call_reward": 0.25, "timeout_s": 1.0})
    yield env
    env.close()


def test_the_evaluator_agrees_with_python():
    for expression in EXPRESSIONS:
        assert evaluate(expression) == format_number(eval(expression)), expression
    assert [evaluate(e) for e in ("7 / 2", "10 / 4 * 2", "0.1 + 0.2", "2 ** -2", "-17 // 5")] == \
        ["3.5", "5", "0.30000000000000004", "0.25", "-4"]


@pytest.mark.parametrize("expression, error", [
    ("", "empty expression"), ("abc", "Name is not allowed"), ("__import__('os')", "Call is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("'1' * 3", "str is not allowed"), ("True + 1", "bool is not allowed"),
    ("1j * 2", "complex is not allowed"), ("1 < 2", "Compare is not allowed"), ("1 << 3", "BinOp is not allowed"),
    ("9**9**9", "exponent 387420489 is above 64"), ("10**100000", "exponent 100000 is above 64"),
    ("(10**60)**20", "more than 1000 digits"), ("(-8) ** 0.5", "not a real number"), ("1e308 * 10", "not finite"),
    ("1 +", "not an expression"),
])
def test_the_evaluator_refuses_what_is_not_bounded_arithmetic(expression, error):
    start = time.monotonic()
    with pytest.raises(ValueError, match=error):
        evaluate(expression)
    assert time.monotonic() - start < 0.5


@pytest.mark.spawn
def test_calls_are_evaluated_in_the_sandbox(calc):
    state = calc.start(RECORD)
    for expression in EXPRESSIONS:
        result = calc.step(state, f"Let me compute. <call>{expression}</call>")
        assert result == StepResult(observation=f"<result>{format_number(eval(expression))}</result>",
                                    reward=0.25, tool_calls=1), expression
    assert calc.step(state, "<call> 6*7 </call>\n ") == StepResult(observation="<result>42</result>", reward=0.25,
                                                                  tool_calls=1)
    # The expression is what follows the last call_open.
    assert calc.step(state, "<call> not this <call>2+2</call>").observation == "<result>4</result>"


@pytest.mark.spawn
@pytest.mark.parametrize("action", [
    "<call>1+2", "<call>1+2</call> and then more", "<call>abc</call>", "<call>__import__('os')</call>",
    "<call></call>", "<call>1/0</call>", "<call>7 % 0</call>", "<call>9**9**9</call>", "<call>10**100000</call>",
    "<call>" + "1+" * 40 + "1</call>",  # 81 characters: over max_expression_chars
])
def test_failed_and_malformed_calls_are_error_observations(calc, action):
    start = time.monotonic()
    assert calc.step(None, action) == ERROR
    assert time.monotonic() - start < 1.0  # refused, never timed out


@pytest.mark.spawn
def test_a_call_that_hangs_is_killed_and_answered_with_the_error(calc, monkeypatch):
    calc.step(None, "<call>1</call>")  # the sandbox is up
    kills = calc.sandbox.kills
    monkeypatch.setattr(calc, "evaluator", "tests.env.sandbox_targets:spin")
    start = time.monotonic()
    assert calc.step(None, "<call>1+1</call>") == ERROR
    assert time.monotonic() - start < 1.0 + 2.0
    assert calc.sandbox.kills == kills + 1
    monkeypatch.undo()
    assert calc.step(None, "<call>1+1</call>").observation == "<result>2</result>"


def test_an_answer_without_a_call_ends_the_episode():
    env = build_environment("calculator", None)
    assert env.step(env.start(RECORD), "The answer is 3.") == StepResult(observation="", reward=0.0, done=True)
    assert env.step(None, "3 </call>") == StepResult(done=True)  # a close marker alone is no call
    assert env.sandbox is None  # no process started for an answer
    env.close()


@pytest.mark.spawn
def test_markers_and_stop_texts_come_from_the_options():
    env = build_environment("calculator", {"call_open": "[[", "call_close": "]]", "result_open": "=> ",
                                           "result_close": "\n", "workers": 1})
    try:
        assert env.stop_texts == ("]]",) and Calculator.stop_texts == ()
        assert env.step(None, "so [[2*(3+4)]]") == StepResult(observation="=> 14\n", tool_calls=1)
        assert env.step(None, "so [[2*(3+4)") == StepResult(observation="=> error\n", tool_calls=1, tool_error=True)
    finally:
        env.close()
    assert env.sandbox is None
    with pytest.raises(RuntimeError, match="the calculator environment is closed"):
        env.step(None, "[[1]]")


@pytest.mark.parametrize("options, message", [
    ({"timeout_s": -1}, "env.options.timeout_s must be > 0, got -1"),
    ({"timeout_s": "soon"}, "env.options.timeout_s must be a number, got 'soon' (str)"),
    ({"memory_limit_mb": 32}, "env.options.memory_limit_mb must be an int >= 64, got 32"),
    ({"workers": 0}, "env.options.workers must be an int >= 1, got 0"),
    ({"workers": 1.5}, "env.options.workers must be an int, got 1.5 (float)"),
    ({"max_expression_chars": 0}, "env.options.max_expression_chars must be an int >= 1, got 0"),
    ({"call_open": ""}, "env.options.call_open must be a non-empty string, got ''"),
    ({"call_close": "<call>"}, "env.options.call_close must differ from env.options.call_open, both are '<call>'"),
    ({"call_reward": "nan"}, "env.options.call_reward must be a finite number, got 'nan' (str)"),
    ({"bogus": 1}, "unknown field(s) ['bogus'] in env.options; valid: ['call_close', 'call_open', "),
])
def test_bad_options_are_one_line_naming_the_field(options, message):
    with pytest.raises(ValueError) as info:
        build_environment("calculator", options)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_unknown_environment_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown env.name 'abacus'; valid names: \[.*'calculator'.*\]"):
        build_environment("abacus", {})


def test_a_plugin_environment_is_found_by_name():
    @ENVIRONMENTS.register("echo_test")
    class Echo(Environment):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Config(Environment.Config):
            prefix: str = "you said: "
            """Text before the echoed action."""

        def start(self, record):
            return {"uid": record.uid}

        def step(self, state, action):
            return StepResult(observation=f"{self.config.prefix}{action} ({state['uid']})", done=action == "bye")

    try:
        env = build_environment("echo_test", {"prefix": "> "})
        assert isinstance(env, Echo) and env.stop_texts == ()
        state = env.start(RECORD)
        assert env.step(state, "hi") == StepResult(observation="> hi (t-0)")
        assert env.step(state, "bye") == StepResult(observation="> bye (t-0)", done=True)
        with pytest.raises(ValueError, match=r"unknown field\(s\) \['suffix'\] in env.options"):
            build_environment("echo_test", {"suffix": "!"})
    finally:
        ENVIRONMENTS.remove("echo_test")
    assert "echo_test" not in ENVIRONMENTS
