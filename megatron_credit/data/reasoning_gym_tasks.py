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
The tokenizer is a Hugging Face one (``data.tokenizer_path``, else the model's). A prompt longer than
``data.max_prompt_len`` tokens is refused with one line (the planner sizes memory for that length).

>>> ReasoningGymSource.Config(task="basic_arithmetic", size=0)
Traceback (most recent call last):
...
ValueError: data.options.size must be an int >= 1, got 0
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_credit.data.dataset import tokenize_prompt
from megatron_credit.data.prompts import _Cursor
from megatron_credit.data.records import ChatMessage, PromptRecord
from megatron_credit.data.source_base import PROMPT_SOURCES, PromptData, PromptSource, hf_tokenizer_of

DATA_SOURCE = "reasoning_gym"
"""The records' ``data_source``: the verifier ``rewards/reasoning_gym.py`` registers."""


@PROMPT_SOURCES.register("reasoning_gym")
class ReasoningGymSource(PromptSource):
    """reasoning-gym's procedural tasks (module docstring)."""

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

        def __post_init__(self) -> None:
            if not isinstance(self.task, str) or not self.task:
                raise ValueError(f"data.options.task must name a reasoning-gym task, got {self.task!r}")
            if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
                raise ValueError(f"data.options.size must be an int >= 1, got {self.size!r}")
            clash = sorted({"seed", "size"} & set(self.task_options))
            if clash:
                raise ValueError(f"data.options.task_options must not set {clash}: the run's seed and "
                                 "data.options.size set them")
            if self.answer_tag is not None and not (self.answer_tag.isidentifier()):
                raise ValueError(f"data.options.answer_tag must be a tag name such as 'answer', got {self.answer_tag!r}")

    def check(self) -> None:
        """The task exists and takes its options (imports reasoning-gym, about a second)."""
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

    def build(self, *, seed, model_path, val_every, val_prompts, log):
        tokenizer = hf_tokenizer_of(self.data, model_path)
        limit = self.data.max_prompt_len
        val = None
        if val_every:
            val = ReasoningGymPrompts(self.task(seed=seed + 1), tokenizer, max_prompt_len=limit).take(val_prompts)
        return PromptData(tokenizer, ReasoningGymPrompts(self.task(seed=seed), tokenizer, max_prompt_len=limit),
                          val, None)


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
