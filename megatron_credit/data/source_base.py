"""The base of a ``data.source`` (``data/sources.py`` holds the registry's built-in sources and documents the
interface): what a source builds (:class:`PromptData`), the class a source derives from (:class:`PromptSource`),
the registry (:data:`PROMPT_SOURCES`) and the Hugging Face tokenizer of a ``data`` section. A source in a file of
its own imports these from here. Nothing heavy is imported at module level."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple

from megatron_credit.registry import Registry
from megatron_credit.typed_build import build_dataclass


class PromptData(NamedTuple):
    """What a source builds (``data.setup.build_data``'s result)."""

    tokenizer: Any
    """The tokenizer prompts are rendered with and the policy generates in."""
    prompts: Any
    """The job's training prompt stream (``data/prompts.py``: ``take(n)``, ``state_dict()``)."""
    val: Any
    """The validation prompts (a list of records), or None when ``train.val_every`` is 0 or there are none."""
    task: Any
    """The task the supervised warm-up trains on (``trainer/warmup.py``), or None."""


class PromptSource:
    """A ``data.source`` (module docstring): built once per launch from the recipe's ``data`` section."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        """A source's options (a recipe's ``data.options``); this one has none."""

    warmup_traces: ClassVar[bool] = False
    """Its :class:`PromptData` has a ``task`` that writes the supervised warm-up's traces (``warmup.steps > 0``
    needs one): the synthetic tasks and reasoning-gym's."""

    def __init__(self, data: Any, config: "PromptSource.Config") -> None:
        self.data, self.config = data, config

    @classmethod
    def from_section(cls, data: Any) -> "PromptSource":
        """This source on the ``data`` section; an unknown option or a wrong type is one ``ValueError``
        naming ``data.options.<field>``."""
        return cls(data, build_dataclass(cls.Config, dict(data.options), "data.options"))

    def check(self) -> None:
        """Refuse, with one ``ValueError`` naming the field, a ``data`` section this source cannot use;
        run when the recipe is loaded. Must not import heavy libraries (none here)."""

    def build(self, *, seed: int, model_path: str | None, val_every: int, val_prompts: int,
              log: Callable[[str], None]) -> PromptData:
        """The run's data (``data.setup.build_data`` documents the arguments)."""
        raise NotImplementedError


PROMPT_SOURCES: Registry[type[PromptSource]] = Registry("data.source")
"""Prompt source classes by name (a recipe's ``data.source``)."""


def hf_tokenizer(path: str, *, field: str):
    """``AutoTokenizer.from_pretrained(path)`` (a folder or a hub name); one that transformers cannot load
    a tokenizer from is a ``ValueError`` naming the recipe field and the path, not a traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{field}: no tokenizer could be loaded from {path!r} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc


def hf_tokenizer_of(d: Any, model_path: str | None):
    """The Hugging Face tokenizer of a ``data`` section: ``data.tokenizer_path``, else the model's
    (``model.name_or_path``); one that cannot be loaded is one line naming the field."""
    return hf_tokenizer(d.tokenizer_path or model_path,
                        field="data.tokenizer_path" if d.tokenizer_path else "model.name_or_path")
