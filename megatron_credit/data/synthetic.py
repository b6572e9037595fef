"""Synthetic verifiable task: multi-operand integer arithmetic answered as ``Answer: N``.

Why this task: the default CPU job must show GRPO working within minutes on a tiny randomly
initialised transformer. With two operands in [0, 9] and "+", the answer is one or two digits, each a
single token of the task's tokenizer (``data/tokenizer.py``, ``split_digits``), and the prompt ends
with ``Answer:`` (the chat template's generation prompt), so a random policy over the default
tokenizer's ~40 tokens already emits the right first digit about once in 40-100 samples: GRPO gets a
signal from step one. Measured with a toy GRPO loop (2 layers, width 64, 32 prompts x 8 samples, Adam
3e-4, one CPU core): accuracy rises from ~1% to the level of always giving the most frequent sum
(~10% for operands in [0, 9], ~20% for [0, 4]) within 10-30 s. Going past that level, i.e. learning
the sums themselves, was not reached in 3 minutes of that loop (it collapsed onto the most frequent
answer); the real trainer's settings (entropy, KL, group size) decide that part. Harder settings
(more operands, larger numbers, "-" and "*") are knobs, not new code.

A trivial policy that always gives the stream's most frequent answer scores ``majority_answer_rate``
(0.10 for the default two operands in [0, 9], 0.20 for ``max_operand=4``); an end-to-end test should
assert that the trained reward beats it, not merely that it rises. ``max_operand=4`` is the easier
setting for a tiny model; it is not the default because the default tokenizer is trained on the
default task's text (digits 0-9 must all occur in it).

Every problem is a pure function of ``(seed, index)``, so a stream is reproducible and can be resumed
or sharded by index without storing it.

>>> task = ArithmeticTask(ArithConfig(seed=0))
>>> p = task.problem(0); (p.question, p.answer)
('9+9=', '18')
>>> task.record(0).messages[0].content, task.record(0).ground_truth, task.record(0).data_source
('9+9=', '18', 'synthetic_arith')
>>> round(majority_answer_rate(ArithConfig()), 2), round(majority_answer_rate(ArithConfig(max_operand=4)), 2)
(0.1, 0.2)
"""
from __future__ import annotations

import collections
import dataclasses
import random

from megatron_credit.data.records import ChatMessage, PromptRecord

DATA_SOURCE = "synthetic_arith"
_MAX_DRAWS = 10_000  # redraws of a problem whose running value went below 0, before giving up


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithConfig:
    """Difficulty knobs of the arithmetic task."""

    seed: int = 0
    """Seed of the problem stream; problem i depends only on (seed, i)."""
    num_operands: int = 2
    """Operands per problem (>= 2)."""
    min_operand: int = 0
    """Smallest operand."""
    max_operand: int = 9
    """Largest operand (inclusive)."""
    ops: tuple[str, ...] = ("+",)
    """Operators drawn uniformly per position, from "+", "-", "*" (evaluated left to right)."""
    allow_negative: bool = False
    """If False, problems whose running value goes below 0 are redrawn."""

    def __post_init__(self):
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
            )
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of ('+', '-', '*'), got {self.ops}")
        # Operands are >= 0, so only "-" lowers the running value; with "-" alone the best draw is the
        # largest first operand minus the smallest ones.
        if (not self.allow_negative and set(self.ops) == {"-"}
                and self.max_operand < (self.num_operands - 1) * self.min_operand):
            raise ValueError(
                "infeasible ArithConfig: with ops=('-',), allow_negative=False, num_operands="
                f"{self.num_operands} and min_operand={self.min_operand}, every problem goes below 0 "
                f"(max_operand={self.max_operand} < (num_operands - 1) * min_operand); "
                "set allow_negative=True, add '+' or '*' to ops, or widen the operand range"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithProblem:
    """One problem: the question text (``"3+4-2="``) and its integer answer as a string."""

    question: str
    answer: str


class ArithmeticTask:
    """Deterministic generator of arithmetic problems and their prompt records."""

    def __init__(self, config: ArithConfig = ArithConfig()):
        self.config = config

    def problem(self, index: int) -> ArithProblem:
        """Problem ``index`` of the stream (pure function of ``(config.seed, index)``)."""
        cfg = self.config
        rng = random.Random(f"{cfg.seed}:{index}")  # str seeds hash deterministically (sha512)
        for _ in range(_MAX_DRAWS):
            operands = [rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(cfg.num_operands)]
            ops = [rng.choice(cfg.ops) for _ in range(cfg.num_operands - 1)]
            value, ok = operands[0], True
            for op, x in zip(ops, operands[1:]):
                value = value + x if op == "+" else value - x if op == "-" else value * x
                ok = ok and (cfg.allow_negative or value >= 0)
            if ok:
                break
        else:
            raise ValueError(
                f"no problem with a running value >= 0 in {_MAX_DRAWS} draws for index {index}: "
                f"num_operands={cfg.num_operands}, min_operand={cfg.min_operand}, "
                f"max_operand={cfg.max_operand}, ops={cfg.ops}, allow_negative=False is (nearly) infeasible; "
                "set allow_negative=True or make '-' less dominant"
            )
        text = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:])) + "="
        return ArithProblem(question=text, answer=str(value))

    def record(self, index: int) -> PromptRecord:
        """Problem ``index`` as a prompt record (one user message; data source "synthetic_arith")."""
        p = self.problem(index)
        return PromptRecord(
            uid=f"{DATA_SOURCE}:{self.config.seed}:{index}",
            data_source=DATA_SOURCE,
            messages=(ChatMessage(role="user", content=p.question),),
            ground_truth=p.answer,
            extra_info={"index": index},
        )

    def records(self, start: int, count: int) -> list[PromptRecord]:
        """Records ``start .. start + count - 1``."""
        return [self.record(i) for i in range(start, start + count)]


def carry_dropped_answer(question: str) -> str:
    """The answer of an addition-only ``question`` by someone who forgets every carry: each column is
    the sum of its digits mod 10 (a systematic misconception for a warm-up to teach and RL to fix).

    >>> carry_dropped_answer("47+38="), carry_dropped_answer("95+17="), carry_dropped_answer("12+34=")
    ('75', '2', '46')
    """
    terms = question.rstrip("=").split("+")
    if not all(t.isdigit() for t in terms):
        raise ValueError(f"carry_dropped_answer needs an addition of non-negative integers, got {question!r}")
    width = max(len(t) for t in terms)
    digits = [sum(int(t.zfill(width)[i]) for t in terms) % 10 for i in range(width)]
    return str(int("".join(map(str, digits))))


def majority_answer_rate(config: ArithConfig = ArithConfig(), *, num_problems: int = 20_000) -> float:
    """Accuracy of always answering the most frequent answer, over problems ``0 .. num_problems - 1``.

    The reward floor a policy reaches without learning arithmetic (it collapses onto one answer).
    """
    task = ArithmeticTask(config)
    counts = collections.Counter(task.problem(i).answer for i in range(num_problems))
    return counts.most_common(1)[0][1] / num_problems
