"""Typed records of the data pipeline: chat messages and prompt records."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatMessage:
    """One chat turn."""

    role: str
    """"system", "user" or "assistant"."""
    content: str
    """The turn's text."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt with what is needed to score its responses."""

    uid: str
    """Stable id (file and row, or task and index); groups of samples of one prompt share it."""
    data_source: str
    """Selects the reward method (``rewards.base.VERIFIER_BY_DATA_SOURCE``)."""
    messages: tuple[ChatMessage, ...]
    """The prompt as chat messages (rendered with the tokenizer's chat template)."""
    ground_truth: str
    """The reference answer."""
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form metadata carried through from the dataset (index, split, ...)."""
    prompt_ids: tuple[int, ...] = ()
    """Token ids of the rendered prompt; empty until tokenized (``data.dataset.tokenize_records``)."""

    def chat(self) -> list[dict[str, str]]:
        """The messages as the list of dicts chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]
