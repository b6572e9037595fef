"""``data.source: reasoning_gym``: the procedural tasks of reasoning-gym, scored by reasoning-gym's own
scorers (``rewards/reasoning_gym.py``).

reasoning-gym (an optional dependency: ``pip install 'megatron-credit[reasoning-gym]'``, imported only
when this source is used) generates problem ``i`` of a task from ``(seed, i)``. A recipe names the task and
its options::

    data:
      source: reasoning_gym
      options: {task: basic_arithmetic, task_options: {min_terms: 2, max_terms: 2, max_digits: 1}}

Training prompt ``k`` is problem ``k mod size`` of the task seeded with the run's seed; validation uses
seed + 1. Each prompt is the task's question as a user message, after the system message
``system_prompt`` (a key of ``reasoning_gym.utils.SYSTEM_PROMPTS``, or a text of its own; null: none).
The tokenizer is a Hugging Face one (``data.tokenizer_path``, else the model's), or, with
``tokenizer: synthetic``, the project's sentencepiece tokenizer (``data/tokenizer.py``, ``data.tokenizer_vocab_size``
pieces) with byte fallback, so that the tiny actor of the CPU demos, trained from scratch, reads any task's
text: digits and operators are pieces, letters bytes. A prompt longer than ``data.max_prompt_len`` tokens is
refused with one line (the planner sizes memory for that length).

The task writes the supervised warm-up's traces (``warmup.steps``, ``trainer/warmup.py``): the answer, or, with
probability ``warmup.retry_prob`` and an environment, a wrong first attempt (one digit of the answer
changed), the environment's answer to it (``env/feedback.py``: "Wrong: 47. Try again."), and the answer
(:meth:`ReasoningGymTask.warmup_turns`).

>>> ReasoningGymSource.Config(task="basic_arithmetic", size=0)
Traceback (most recent call last):
...
ValueError: data.options.size must be an int >= 1, got 0
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_credit.data.dataset import tokenize_prompt
from megatron_credit.data.prompts import _Cursor
from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.data.source_base import PROMPT_SOURCES, PromptData, PromptSource, hf_tokenizer_of

DATA_SOURCE = "reasoning_gym"
"""The records' ``data_source``: the verifier ``rewards/reasoning_gym.py`` registers."""
BYTE_FALLBACK_VOCAB = 300
"""The smallest ``data.tokenizer_vocab_size`` of the synthetic tokenizer with byte fallback (``data/tokenizer.py``)."""


@PROMPT_SOURCES.register("reasoning_gym")
class ReasoningGymSource(PromptSource):
    """reasoning-gym's procedural tasks (module docstring)."""

    warmup_traces = True

    @dataclass(frozen=True, kw_only=True)
    class Config(PromptSource.Config):
        """``data.options`` of ``data.source: reasoning_gym``."""

        task: str = ""
        """reasoning-gym's name of the task (``reasoning_gym.factory.DATASETS``), e.g. ``basic_arithmetic``."""
        task_options: Mapping[str, Any] = field(default_factory=dict)
        """The task's own options (the fields of its reasoning-gym config, without ``seed`` and ``size``)."""
        size: int = 100_000
        """Distinct problems: the stream repeats after this many."""
        system_prompt: Optional[str] = "default"
        """The system message before each question: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (one
        word: its text), or the text itself (several words); null: none."""
        answer_tag: Optional[str] = "answer"
        """The answer is the response's last ``<tag>...</tag>``; null: the whole response (stripped)."""
        tokenizer: str = "model"
        """``model``: the Hugging Face tokenizer (``data.tokenizer_path``, else the model's); ``synthetic``: the
        project's sentencepiece tokenizer with byte fallback (module docstring), for a model trained from scratch."""

        def __post_init__(self) -> None:
            if not isinstance(self.task, str) or not self.task:
                raise ValueError(f"data.options.task must name a reasoning-gym task, got {self.task!r}")
            if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
                raise ValueError(f"data.options.size must be an int >= 1, got {self.size!r}")
            clash = sorted({"seed", "size"} & set(self.task_options))
            if clash:
                raise ValueError(f"data.options.task_options must not set {clash}: the run's seed and "
                                 "data.options.size set them")
            if self.tokenizer not in ("model", "synthetic"):
                raise ValueError(f"data.options.tokenizer must be 'model' or 'synthetic', got {self.tokenizer!r}")
            if self.answer_tag is not None and not (self.answer_tag.isidentifier()):
                raise ValueError(f"data.options.answer_tag must be a tag name such as 'answer', got {self.answer_tag!r}")

    def check(self) -> None:
        """The task exists and takes its options (imports reasoning-gym, about a second); the synthetic
        tokenizer's byte pieces fit its vocabulary."""
        if self.config.tokenizer == "synthetic" and self.data.tokenizer_vocab_size < BYTE_FALLBACK_VOCAB:
            raise ValueError(f"data.tokenizer_vocab_size must be >= {BYTE_FALLBACK_VOCAB} with data.options.tokenizer: "
                             f"synthetic (256 byte pieces), got {self.data.tokenizer_vocab_size}")
        self.task(seed=0)

    def task(self, *, seed: int) -> "ReasoningGymTask":
        """The task seeded with ``seed``; an unknown task, option or value is one line naming the field."""
        from megatron_credit.rewards.reasoning_gym import import_reasoning_gym

        c = self.config
        rg = import_reasoning_gym("data.source: reasoning_gym")
        if c.task not in rg.factory.DATASETS:
            raise ValueError(f"data.options.task: unknown reasoning-gym task {c.task!r}; valid names: "
                             f"{sorted(rg.factory.DATASETS)}")
        literal = c.system_prompt is not None and len(c.system_prompt.split()) > 1
        if c.system_prompt is not None and not literal and c.system_prompt not in rg.utils.SYSTEM_PROMPTS:
            raise ValueError(f"data.options.system_prompt: unknown reasoning-gym system prompt {c.system_prompt!r}; "
                             f"valid names: {sorted(rg.utils.SYSTEM_PROMPTS)} (or a text of several words, or null: none)")
        config = {**dict(c.task_options), "seed": seed, "size": c.size}
        try:
            dataset = rg.create_dataset(c.task, **config)
        except (TypeError, ValueError, AssertionError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"data.options.task_options: reasoning-gym task {c.task!r} refuses "
                             f"{dict(c.task_options)}: {first}") from None
        system = c.system_prompt if literal or c.system_prompt is None else rg.utils.SYSTEM_PROMPTS[c.system_prompt]
        return ReasoningGymTask(dataset, task=c.task, config=config, system=system, answer_tag=c.answer_tag)

    def tokenizer(self, model_path: Optional[str]):
        """The prompts' tokenizer (``data.options.tokenizer``)."""
        if self.config.tokenizer == "model":
            return hf_tokenizer_of(self.data, model_path)
        from megatron_credit.data.tokenizer import ArithTokenizerConfig, load_arith_tokenizer

        return load_arith_tokenizer(ArithTokenizerConfig(vocab_size=self.data.tokenizer_vocab_size,
                                                         byte_fallback=True, answer_prefix=False))

    def build(self, *, seed, model_path, val_every, val_prompts, log):
        tokenizer = self.tokenizer(model_path)
        limit = self.data.max_prompt_len
        val = None
        if val_every:
            val = ReasoningGymPrompts(self.task(seed=seed + 1), tokenizer, max_prompt_len=limit).take(val_prompts)
        task = self.task(seed=seed)
        return PromptData(tokenizer, ReasoningGymPrompts(task, tokenizer, max_prompt_len=limit), val, task)


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
    """A seeded reasoning-gym dataset whose problem ``i`` is a prompt record."""

    dataset: Any
    task: str
    config: dict
    """What ``dataset`` was built with (its seed and size included): the verifier rebuilds its scorer from it."""
    system: Optional[str]
    answer_tag: Optional[str]

    def record(self, index: int) -> PromptRecord:
        """Problem ``index mod size`` as a record; its ground truth is the JSON the verifier reads."""
        i = index % self.config["size"]
        entry = self.dataset[i]
        messages = (ChatMessage(role="user", content=entry["question"]),)
        if self.system is not None:
            messages = (ChatMessage(role="system", content=self.system),) + messages
        truth = json.dumps({"task": self.task, "config": self.config, "answer": entry["answer"],
                            "metadata": entry.get("metadata", {}), "answer_tag": self.answer_tag},
                           sort_keys=True, default=str)
        return PromptRecord(uid=f"{DATA_SOURCE}:{self.task}:{self.config['seed']}:{i}", data_source=DATA_SOURCE,
                            messages=messages, ground_truth=truth, extra_info={"index": i, "task": self.task})

    def warmup_turns(self, index: int, rng: random.Random, *, retry_prob: float = 0.0, env: Any = None,
                     eos_id: int = -1) -> list[tuple[str | list[int], bool]]:
        """The warm-up trace of problem ``index`` as ``(text or token ids, is the model's)`` pieces, in the
        order the rollout appends them: the answer (in its ``<answer_tag>``), or, with probability
        ``retry_prob`` (one ``rng`` draw) and an ``env`` (the run's environment) that answers it without
        ending the episode, a wrong attempt and ``eos_id`` (each attempt ends on EOS), the observation
        ``env.step`` returns for it, and the answer. The stop token after the last piece is the caller's.

        >>> from megatron_credit.env.feedback import Feedback
        >>> task = ReasoningGymSource.from_section(type("D", (), {"options": {"task": "basic_arithmetic",
        ...     "answer_tag": None}})).task(seed=0)
        >>> task.record(1).messages[-1].content, task.warmup_turns(1, random.Random(0))
        ('Calculate 5 - 3 - 6.', [('-4', True)])
        >>> task.warmup_turns(1, random.Random(0), retry_prob=1.0, env=Feedback(Feedback.Config()), eos_id=3)
        [('-0', True), ([3], True), ('\\nWrong: -0. Try again.\\n', False), ('-4', True)]
        """
        rec = self.record(index)
        answer = str(self.dataset[index % self.config["size"]]["answer"])
        if env is not None and rng.random() < retry_prob:
            wrong = _slip(answer, rng)
            res = env.step(env.start(rec), self._tagged(wrong)) if wrong is not None else None
            if res is not None and not res.done:
                return [(self._tagged(wrong), True), ([eos_id], True), (res.observation, False),
                        (self._tagged(answer), True)]
        return [(self._tagged(answer), True)]

    def _tagged(self, answer: str) -> str:
        return answer if self.answer_tag is None else f"<{self.answer_tag}>{answer}</{self.answer_tag}>"


def _slip(answer: str, rng: random.Random) -> Optional[str]:
    """``answer`` with one of its digits (chosen by ``rng``) replaced by another digit; None when it has none.

    >>> _slip("-47", random.Random(0)), _slip("none", random.Random(0))
    ('-46', None)
    """
    places = [i for i, c in enumerate(answer) if c.isdigit()]
    if not places:
        return None
    i = rng.choice(places)
    digit = rng.choice([d for d in "0123456789" if d != answer[i]])
    return answer[:i] + digit + answer[i + 1:]


class ReasoningGymPrompts(_Cursor):
    """Problems of a :class:`ReasoningGymTask`, in order (item ``k`` is problem ``k mod size``)."""

    def __init__(self, task: ReasoningGymTask, tokenizer: Any, *, max_prompt_len: int):
        self.task, self.tokenizer, self.max_prompt_len = task, tokenizer, max_prompt_len
        self.cursor = 0

    def take(self, n: int) -> list[PromptRecord]:
        out = []
        for k in range(self.cursor, self.cursor + n):
            rec = self.task.record(k)
            rec = dataclasses.replace(rec, prompt_ids=tuple(tokenize_prompt(self.tokenizer, rec.chat())))
            if len(rec.prompt_ids) > self.max_prompt_len:
                raise ValueError(f"data.max_prompt_len={self.max_prompt_len}: prompt {rec.uid} is "
                                 f"{len(rec.prompt_ids)} tokens; raise data.max_prompt_len or choose smaller "
                                 "data.options.task_options")
            out.append(rec)
        self.cursor += n
        return out
