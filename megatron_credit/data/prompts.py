"""Prompt streams for the trainer: which prompts each data-parallel rank takes, resumably.

A stream hands out tokenized :class:`~megatron_credit.data.records.PromptRecord` s. The trainer reads one
stream for the whole job, the same on every rank (``dp_size=1``; its engines split each draw); a share
of it (rank ``r`` of ``d`` takes items ``r, r + d, r + 2d, ...``) serves readers that each need their own
prompts. ``state_dict()`` is the cursor: a resumed run continues with exactly
the next prompts.

- :class:`SyntheticPrompts`: the arithmetic task, item ``i`` is problem ``i`` (no files).
- :class:`DatasetPrompts`: a loaded :class:`~megatron_credit.data.dataset.PromptDataset`, reshuffled
  every epoch with ``(seed, epoch)``.

>>> from megatron_credit.data.synthetic import ArithConfig, ArithmeticTask
>>> class Tok:
...     def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
...         return [len(messages[0]["content"])]
>>> s = SyntheticPrompts(ArithmeticTask(ArithConfig(seed=0)), Tok(), dp_rank=1, dp_size=2)
>>> [r.extra_info["index"] for r in s.take(3)], s.state_dict()
([1, 3, 5], {'cursor': 3, 'scope': 'rank'})
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
    """The resumable part of a stream: how many items this rank has taken."""

    cursor: int = 0
    dp_size: int = 1
    dropped_prompts: int = 0
    """Prompts of the stream's files dropped at load (over ``data.max_prompt_len``): ``data/dropped_prompts``."""

    def state_dict(self) -> dict[str, Any]:
        """The cursor; ``scope``: "job" for the trainer's one stream of the whole job, "rank" for a share."""
        return {"cursor": self.cursor, "scope": "job" if self.dp_size == 1 else "rank"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class SyntheticPrompts(_Cursor):
    """Problems of an :class:`~megatron_credit.data.synthetic.ArithmeticTask`, sharded over DP."""

    def __init__(self, task, tokenizer, *, dp_rank: int = 0, dp_size: int = 1):
        self.task, self.tokenizer, self.dp_rank, self.dp_size = task, tokenizer, dp_rank, dp_size
        self.cursor = 0

    def take(self, n: int) -> list[PromptRecord]:
        out = [_tokenized(self.task.record((self.cursor + k) * self.dp_size + self.dp_rank), self.tokenizer)
               for k in range(n)]
        self.cursor += n
        return out


class DatasetPrompts(_Cursor):
    """The records of a prompt dataset, one shuffled pass per epoch, sharded over DP."""

    def __init__(self, records, tokenizer, *, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if len(records) < dp_size:
            raise ValueError(f"the dataset has {len(records)} prompts, fewer than the {dp_size} "
                             "data-parallel ranks")
        self.records, self.tokenizer, self.seed = records, tokenizer, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cursor = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        mine = order[self.dp_rank::self.dp_size][: len(self.records) // self.dp_size]
        self._epoch_order = (epoch, mine)
        return mine

    def take(self, n: int) -> list[PromptRecord]:
        per_epoch = len(self.records) // self.dp_size
        out = []
        for k in range(self.cursor, self.cursor + n):
            epoch, i = divmod(k, per_epoch)
            out.append(_tokenized(self.records[self._order(epoch)[i]], self.tokenizer))
        self.cursor += n
        return out
