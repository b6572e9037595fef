"""Credit-sensitive synthetic task: a chain of one-digit additions written out step by step.

``chain{N}``: the prompt is ``N`` one-digit operands joined by ``+`` (``3+5+2+7=``), the response writes
every running sum (``" 3 8 10 17"``) and only the final number is scored (``rewards/arith.py``,
``score_chain``). One wrong running sum makes every later sum wrong with it, so a response fails
because of *one* token region while all the tokens after it are right given it: an outcome reward
blames the whole response, per-token credit can find the step. That is what the credit testbed
(``tools/credit_testbed.py``) measures.

The supervised warm-up (``trainer/warmup.py``) fits labels that, with probability ``slip_prob``, slip
once: one running sum is off by one (up or down) and the later sums continue from the slipped value, so
the chain stays internally consistent. Where slips go is the task's ``decisive`` knob: ``any`` step,
only the ``early`` half (steps ``1 .. ceil(N/2)``) or only the ``late`` half (the rest). The warmed-up
policy slips at about the label rate, spread over that window, and RL has to remove the slips; the
``early`` / ``late`` variants move the decisive tokens to the start or the end of the response.

Every problem and every warm-up label is a pure function of ``(seed, index)``.

>>> task = ChainTask(ChainConfig(seed=0, num_operands=4))
>>> p = task.problem(0); (p.question, p.answer, p.sums)
('2+9+4+5=', '20', (2, 11, 15, 20))
>>> task.response_text(p.sums)
' 2 11 15 20'
>>> task.record(0).ground_truth, task.record(0).data_source
('20', 'synthetic_chain')
>>> slipped = task.slipped_sums(p, step=2, delta=1); slipped, task.response_text(slipped)
((2, 12, 16, 21), ' 2 12 16 21')
>>> ChainConfig(num_operands=6, decisive="late").slip_steps()
(4, 5, 6)
"""
from __future__ import annotations

import dataclasses
import random

from megatron_credit.data.records import ChatMessage, PromptRecord

DATA_SOURCE = "synthetic_chain"
DECISIVE = ("any", "early", "late")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainConfig:
    """Knobs of the chain task."""

    seed: int = 0
    """Seed of the problem stream; problem i depends only on (seed, i)."""
    num_operands: int = 6
    """Operands (= written running sums) per problem, >= 2."""
    min_operand: int = 0
    """Smallest operand (one digit)."""
    max_operand: int = 9
    """Largest operand (one digit, inclusive)."""
    decisive: str = "any"
    """Steps where warm-up slips happen: ``any``, ``early`` (first half) or ``late`` (second half)."""

    def __post_init__(self):
        if self.num_operands < 2:
            raise ValueError(f"data.num_operands must be >= 2 for the chain task, got {self.num_operands}")
        if not 0 <= self.min_operand <= self.max_operand <= 9:
            raise ValueError("the chain task needs one-digit operands: 0 <= data.min_operand <= "
                             f"data.max_operand <= 9, got {self.min_operand}, {self.max_operand}")
        if self.decisive not in DECISIVE:
            raise ValueError(f"data.decisive must be one of {DECISIVE}, got {self.decisive!r}")

    def slip_steps(self) -> tuple[int, ...]:
        """1-based steps (running sums) where a warm-up slip may happen."""
        n, half = self.num_operands, (self.num_operands + 1) // 2
        steps = {"any": range(1, n + 1), "early": range(1, half + 1), "late": range(half + 1, n + 1)}
        return tuple(steps[self.decisive])

    def max_response_tokens(self) -> int:
        """An upper bound of the response's tokens: a space and at most two digits per sum, plus the stop
        token (sums of one-digit operands stay below 100 for ``num_operands <= 11``; more digits if not)."""
        digits = len(str(self.num_operands * 9 + 1))
        return self.num_operands * (1 + digits) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainProblem:
    """One problem: the question (``"3+5+2="``), the final answer and every running sum."""

    question: str
    answer: str
    operands: tuple[int, ...]
    sums: tuple[int, ...]


class ChainTask:
    """Deterministic generator of chain problems, their records and their warm-up labels."""

    def __init__(self, config: ChainConfig = ChainConfig()):
        self.config = config

    def problem(self, index: int) -> ChainProblem:
        """Problem ``index`` of the stream (pure function of ``(config.seed, index)``)."""
        cfg = self.config
        rng = random.Random(f"chain:{cfg.seed}:{index}")
        operands = tuple(rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(cfg.num_operands))
        sums, total = [], 0
        for x in operands:
            total += x
            sums.append(total)
        return ChainProblem(question="+".join(map(str, operands)) + "=", answer=str(total), operands=operands,
                            sums=tuple(sums))

    @staticmethod
    def response_text(sums) -> str:
        """The response that writes ``sums``: ``" s1 s2 ... sN"`` (after the prompt's ``Answer:``)."""
        return "".join(f" {s}" for s in sums)

    @staticmethod
    def slipped_sums(problem: ChainProblem, *, step: int, delta: int) -> tuple[int, ...]:
        """The running sums with sum ``step`` (1-based) off by ``delta`` and every later sum following it.
        A slip below 0 goes up instead (a written sum is never negative)."""
        if problem.sums[step - 1] + delta < 0:
            delta = -delta
        return tuple(s + delta if k >= step else s for k, s in enumerate(problem.sums, start=1))

    def warmup_response(self, index: int, rng: random.Random, *, slip_prob: float) -> str:
        """The warm-up label of problem ``index``: the correct chain, or with probability ``slip_prob`` a
        chain that slips by one at a step drawn uniformly from ``config.slip_steps()`` (``rng`` draws)."""
        p = self.problem(index)
        if rng.random() < slip_prob:
            step = rng.choice(self.config.slip_steps())
            return self.response_text(self.slipped_sums(p, step=step, delta=rng.choice((-1, 1))))
        return self.response_text(p.sums)

    def record(self, index: int) -> PromptRecord:
        """Problem ``index`` as a prompt record (one user message; data source ``synthetic_chain``)."""
        p = self.problem(index)
        return PromptRecord(
            uid=f"{DATA_SOURCE}:{self.config.seed}:{index}",
            data_source=DATA_SOURCE,
            messages=(ChatMessage(role="user", content=p.question),),
            ground_truth=p.answer,
            extra_info={"index": index, "sums": list(p.sums)},
        )

    def records(self, start: int, count: int) -> list[PromptRecord]:
        """Records ``start .. start + count - 1``."""
        return [self.record(i) for i in range(start, start + count)]


def first_wrong_step(response: str, sums) -> int | None:
    """1-based index of the first running sum the response gets wrong (a missing or unparsable number
    counts as wrong), or None if all ``len(sums)`` are right: the decisive step of a failed response.

    >>> first_wrong_step(" 6 13 13 17", (6, 12, 12, 16)), first_wrong_step(" 6 12", (6, 12, 12)), \
first_wrong_step(" 6 12 12", (6, 12, 12))
    (2, 3, None)
    """
    written = response.split()
    for k, s in enumerate(sums, start=1):
        if k > len(written) or written[k - 1] != str(s):
            return k
    return None
