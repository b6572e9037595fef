"""What the multi-turn loop checks before it uses an environment's output or a tokenizer's text: a step's
result (type, token ids within the vocabulary, a finite reward, bool flags), the vocabulary bound, a stop
text that must be one token, and how many characters one token may cover (docs/multi_turn.md)."""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from megatron_credit.env.base import StepResult


def longest_token_chars(tokenizer) -> Optional[int]:
    """An upper bound on the characters of text one token covers: the longest entry of the tokenizer's
    vocabulary as it spells it (a byte-level BPE spells each byte as one character, a sentencepiece one a
    space as one ``▁``, a byte-fallback token as ``<0x0A>``: never shorter than the text it stands for);
    None when the tokenizer has no ``get_vocab``. ``k`` tokens cover at most ``k`` times it, so an
    observation longer than the room left times it is cut to that many characters before it is tokenized:
    a 100,000-character observation costs the tokens it can use, not a tokenization of all of it."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else None
    return max((len(t) for t in vocab), default=None) if isinstance(vocab, dict) and vocab else None


def single_token(tokenizer, text: str, *, field: str) -> int:
    """The one token id of ``text`` (an environment's stop text must be one token: the engine stops on ids)."""
    ids = tokenizer.encode(text)
    back = tokenizer.decode(ids) if len(ids) == 1 else None
    if len(ids) != 1 or back != text:  # an unknown text can come out as one <unk>: it must decode back to itself
        what = f"{len(ids)} tokens {ids}" if len(ids) != 1 else f"the token {ids} that decodes to {back!r}"
        raise ValueError(f"{field}: the environment's stop text {text!r} is {what} under this tokenizer; a turn "
                         "can only end on a single token of its own (add it to the tokenizer's special tokens, or "
                         "choose a marker that is one token)")
    return int(ids[0])


class EnvironmentFault(Exception):
    """An environment's output the loop cannot use; its message is the one-line reason."""


def check_step(res: Any, vocab_size: Optional[int]) -> None:
    """Raise :class:`EnvironmentFault` when ``res``, what ``Environment.step`` returned, is not a
    :class:`StepResult` the loop can use: an observation that is text or token ids in ``[0, vocab_size)``
    (None: only ``>= 0`` is checked), a finite real reward, bool ``done`` and ``tool_error``, a count of
    tool calls >= 0. The observation's length is not checked: the loop cuts it to the token budget."""

    def what(x: Any) -> str:
        text = repr(x)
        return f"{text[:40]}..." if len(text) > 40 else text

    if not isinstance(res, StepResult):
        raise EnvironmentFault(f"step returned {type(res).__name__} {what(res)}, not a StepResult")
    obs = res.observation
    if isinstance(obs, (list, tuple)):
        for t in obs:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                raise EnvironmentFault(f"step's observation holds {type(t).__name__} {what(t)}, not a token id")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise EnvironmentFault(f"step's observation token id {int(t)} is outside the vocabulary "
                                       f"[0, {vocab_size if vocab_size is not None else 'inf'})")
    elif not isinstance(obs, str):
        raise EnvironmentFault(f"step's observation is {type(obs).__name__} {what(obs)}, not text or a list of "
                               "token ids")
    if not isinstance(res.reward, numbers.Real) or not math.isfinite(res.reward):
        raise EnvironmentFault(f"step's reward is {type(res.reward).__name__} {what(res.reward)}, not a finite "
                               "number")
    for name in ("done", "tool_error"):
        if not isinstance(getattr(res, name), bool):
            value = getattr(res, name)
            raise EnvironmentFault(f"step's {name} is {type(value).__name__} {what(value)}, not a bool")
    if not isinstance(res.tool_calls, numbers.Integral) or isinstance(res.tool_calls, bool) or res.tool_calls < 0:
        raise EnvironmentFault(f"step's tool_calls is {type(res.tool_calls).__name__} {what(res.tool_calls)}, not "
                               "an int >= 0")


def vocab_bound(engine, tokenizer) -> Optional[int]:
    """The token ids an observation may hold: below the tokenizer's length and the engine's model's
    vocabulary (the smaller, where both are known); None when neither is."""
    known = []
    try:
        known.append(len(tokenizer))
    except TypeError:
        pass
    for config in (getattr(engine, "hf_config", None), getattr(getattr(engine, "model", None), "config", None)):
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            known.append(size)
    return min(known) if known else None
