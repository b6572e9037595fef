"""The job's prompt stream: which prompts each iteration draws, resumably.

A stream hands out tokenized :class:`~megatron_credit.data.records.PromptRecord` s. The trainer reads one
stream for the whole job, the same on every rank: each draw takes ``rollout.prompts_per_step`` prompts,
which the engines split (``rollout.placement``), so what is drawn depends on neither the number of
ranks nor of engines. ``state_dict()`` is the cursor: a resumed run, on any layout, continues with
exactly the next prompts.

- :class:`SyntheticPrompts`: the arithmetic task, item ``i`` is problem ``i`` (no files).
- :class:`DatasetPrompts`: a loaded :class:`~megatron_credit.data.dataset.PromptDataset`, reshuffled
  every epoch with ``(seed, epoch)``.

>>> from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
>>> class Tok:
...     def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
...         return [len(messages[0]["content"])]
>>> s = SyntheticPrompts(ArithmeticTask(ArithConfig(seed=0)), Tok())
>>> [r.extra_info["index"] for r in s.take(3)], s.state_dict()
([0, 1, 2], {'cursor': 3, 'scope': 'job'})
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from megatron_credit.data.records import PromptRecord


def _tokenized(record: PromptRecord, tokenizer: Any) -> PromptRecord:
    if record.prompt_ids:
        return record
    ids = tokenizer.apply_chat_template(record.chat(), tokenize=True, add_generation_prompt=True)
    return dataclasses.replace(record, prompt_ids=tuple(int(i) for i in ids))


class _Cursor:
    """The resumable part of a stream: how many items the job has taken."""

    cursor: int = 0
    dropped_prompts: int = 0
    """Prompts of the stream's files dropped at load (over ``data.max_prompt_len``): ``data/dropped_prompts``."""

    def state_dict(self) -> dict[str, Any]:
        """The cursor; ``scope: "job"`` tells it from the per-rank cursors of older checkpoints."""
        return {"cursor": self.cursor, "scope": "job"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class SyntheticPrompts(_Cursor):
    """Problems of an :class:`~megatron_credit.data.synthetic.ArithmeticTask`, in order."""

    def __init__(self, task, tokenizer):
        self.task, self.tokenizer = task, tokenizer
        self.cursor = 0

    def take(self, n: int) -> list[PromptRecord]:
        out = [_tokenized(self.task.record(self.cursor + k), self.tokenizer) for k in range(n)]
        self.cursor += n
        return out


class DatasetPrompts(_Cursor):
    """The records of a prompt dataset, one shuffled pass per epoch."""

    def __init__(self, records, tokenizer, *, seed: int):
        if not records:
            raise ValueError("the dataset has no prompts")
        self.records, self.tokenizer, self.seed = records, tokenizer, seed
        self.cursor = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        self._epoch_order = (epoch, order)
        return order

    def take(self, n: int) -> list[PromptRecord]:
        out = []
        for k in range(self.cursor, self.cursor + n):
            epoch, i = divmod(k, len(self.records))
            out.append(_tokenized(self.records[self._order(epoch)[i]], self.tokenizer))
        self.cursor += n
        return out
