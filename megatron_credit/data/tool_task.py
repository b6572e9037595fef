"""The calculator task: multiplication that the model may answer in its head or with a tool call.

The prompt is ``<|user|>37*48=<|assistant|>`` (the tokenizer's ``answer_prefix=False``: unlike
``synthetic_arith``, the generation prompt does not end with ``Answer:``, so the model chooses the form of
its reply). It either answers at once, ``Answer:1776</s>``, or calls the calculator environment
(``env.name: calculator``, ``env/calculator.py``) in two turns:

1. ``<call>37*48</call>``: the turn ends on the ``</call>`` token (a stop text of the environment);
2. the environment appends the observation ``<result>1776</result>`` (tokens the model did not write);
3. ``Answer:1776</s>``.

The records are those of :class:`~megatron_credit.data.synthetic.ArithmeticTask` (data source
``synthetic_arith``), so the verifier is ``score_arith`` on the last turn's text: ``Answer:1776`` is
correct, a trajectory that stops at a call never is. The four markers are single tokens of the task's
tokenizer (``ArithTokenizerConfig.extra_symbols``), the calculator's defaults.

The supervised warm-up (``trainer/warmup.py``) fits traces of which a fraction ``tool_prob`` call the tool
and copy its result; :meth:`ToolTask.warmup_turns` gives a trace as the pieces the multi-turn rollout
appends, so the warm-up's token boundaries and loss mask are the rollout's.

>>> task = ToolTask(ArithConfig(seed=0, ops=("*",), min_operand=10, max_operand=99))
>>> rec = task.record(0); rec.messages[0].content, rec.ground_truth, rec.data_source
('84*96=', '8064', 'synthetic_arith')
>>> tool_trace("37*48=", "1776")
('<call>37*48</call>', '<result>1776</result>', 'Answer:1776')
"""
from __future__ import annotations

import random

from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
from megatron_credit.rewards.arith import ANSWER_PREFIX

TOOL_MARKERS = ("<call>", "</call>", "<result>", "</result>")
"""The calculator environment's default ``call_open, call_close, result_open, result_close``."""


def tool_trace(question: str, answer: str, markers: tuple[str, ...] = TOOL_MARKERS) -> tuple[str, str, str]:
    """(call turn, observation, answer turn) of a problem solved with the calculator: the call of the
    question's expression (its trailing ``=`` dropped), the environment's answer, and the copied result."""
    call_open, call_close, result_open, result_close = markers
    return (call_open + question.removesuffix("=") + call_close, result_open + answer + result_close,
            ANSWER_PREFIX + answer)


class ToolTask(ArithmeticTask):
    """Arithmetic problems (multiplication in the demo) whose warm-up traces may call the calculator."""

    def __init__(self, config: ArithConfig = ArithConfig(ops=("*",)), *,
                 markers: tuple[str, ...] = TOOL_MARKERS):
        super().__init__(config)
        if len(markers) != 4:
            raise ValueError(f"markers must be (call_open, call_close, result_open, result_close), got {markers!r}")
        self.markers = tuple(markers)

    def warmup_turns(self, index: int, rng: random.Random, *, tool_prob: float) -> list[tuple[str, bool]]:
        """The warm-up trace of problem ``index`` as ``(text, is the model's)`` pieces, in the order the
        rollout appends them: with probability ``tool_prob`` (one ``rng`` draw) the call turn, the
        observation (not the model's) and the answer turn, else the answer turn alone. The stop token
        after the last piece is the caller's.

        >>> task = ToolTask(ArithConfig(ops=("*",)))
        >>> task.warmup_turns(0, random.Random(0), tool_prob=1.0)
        [('<call>9*9</call>', True), ('<result>81</result>', False), ('Answer:81', True)]
        >>> task.warmup_turns(0, random.Random(0), tool_prob=0.0)
        [('Answer:81', True)]
        """
        p = self.problem(index)
        call, observation, answer = tool_trace(p.question, p.answer, self.markers)
        if rng.random() < tool_prob:
            return [(call, True), (observation, False), (answer, True)]
        return [(answer, True)]
