"""Plain mappings (parsed YAML) -> keyword-only dataclasses, with every value checked against its field's
type hint. Standard library only: the recipe's sections (``recipe/sections.py``, ``recipe/env_section.py``)
and the algorithms' typed configs (``algorithm/``) are all built here, so none of them imports another to
build.

A field's hint says what it takes: ``bool``, ``int``, ``float``, ``str``, a ``Literal`` of choices, a
mapping (``Mapping[str, Any]``), a tuple or list of checked elements, a nested dataclass, any of them
``Optional``. A number field also declares the interval it lives in, ``Annotated[int, Range(ge=1)]``
(the aliases below name the usual ones), so a count of 0 or a negative learning rate is refused when the
recipe loads, in one line naming the field, not when the model is built. ``float`` fields are finite.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True, kw_only=True)
... class Knobs:
...     lr: PositiveFloat = 1.0
...     gpus: tuple[NonNegativeInt, ...] = ()
>>> build_dataclass(Knobs, {"lr": "1e-6", "gpus": [0, 1]}, "optim")
Knobs(lr=1e-06, gpus=(0, 1))
>>> build_dataclass(Knobs, {"lrr": 1}, "optim")
Traceback (most recent call last):
...
ValueError: unknown field(s) ['lrr'] in optim; valid: ['gpus', 'lr']
>>> build_dataclass(Knobs, {"lr": -5}, "optim")
Traceback (most recent call last):
...
ValueError: optim.lr must be > 0, got -5
>>> build_dataclass(Knobs, {"gpus": 1}, "optim")
Traceback (most recent call last):
...
ValueError: optim.gpus must be a list, got 1 (int)
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from typing import Annotated, Any, Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Range:
    """The interval a number field's value must lie in: ``ge`` / ``gt`` below, ``le`` / ``lt`` above
    (None: unbounded on that side), and a ``note`` the refusal adds (what a bound value means). Declared
    in the field's hint: ``Annotated[float, Range(gt=0)]``.

    >>> Range(ge=0, lt=1).refusal(1.0), Range(ge=0, note="0 = off").refusal(-5), Range(ge=1).refusal(3)
    ('must be in [0, 1)', 'must be >= 0 (0 = off)', None)
    """

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    note: str = ""

    def __str__(self) -> str:
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"{'>=' if self.ge is not None else '>'} {low[1:]}"
        elif high:
            text = f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        else:
            text = "a finite number"
        return f"{text} ({self.note})" if self.note else text

    def refusal(self, value: float) -> Optional[str]:
        """``"must be ..."`` when ``value`` lies outside, else None."""
        inside = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if inside else f"must be {self}"


PositiveInt = Annotated[int, Range(ge=1)]
"""A size or a count where 0 means nothing (steps, ranks, samples, tokens)."""
NonNegativeInt = Annotated[int, Range(ge=0)]
"""A count whose 0 has a meaning its docstring states (0: off, none, never), or an index."""
AnyInt = Annotated[int, Range()]
"""An int whose sign means something (an offset); none of the recipe's today."""
PositiveFloat = Annotated[float, Range(gt=0)]
"""A rate, a timeout, a temperature, a scale: 0 means nothing."""
NonNegativeFloat = Annotated[float, Range(ge=0)]
"""A coefficient or a clip whose 0 means off."""
UnitFloat = Annotated[float, Range(ge=0, le=1)]
"""A probability, a gate, a discount: in [0, 1]."""
AnyFloat = Annotated[float, Range()]
"""A finite number of either sign (a threshold on a signed statistic)."""

_NONE = type(None)
_MAPPINGS = (dict, collections.abc.Mapping, typing.Mapping)
_SEQUENCES = (tuple, list, collections.abc.Sequence, typing.Sequence)


def build_dataclass(cls, data: Mapping[str, Any], where: str):
    """Build dataclass ``cls`` from ``data``, recursing into dataclass-typed fields; unknown keys fail."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'recipe'} must be a mapping, got {data!r} ({type(data).__name__})")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in {where or 'recipe'}; valid: {sorted(names)}")
    kwargs = {}
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        hint = hints[key]
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            if isinstance(value, Mapping) and defaults[key].metadata.get("partial_override"):
                value = {**own_default(defaults[key]), **value}  # keys not given keep the field's default
            kwargs[key] = build_dataclass(hint, value, path)
        else:
            kwargs[key] = check_value(hint, value, path)
    return cls(**kwargs)


def own_default(field: dataclasses.Field) -> dict[str, Any]:
    """The top-level values of a dataclass field's default. Used for fields declared with
    ``metadata={"partial_override": True}`` (e.g. ``PhaseThresholds(entropy_below=...)``), so that a
    partial mapping overrides only the keys it names instead of starting from the class's defaults."""
    if field.default is not dataclasses.MISSING:
        default = field.default
    else:
        default = field.default_factory()
    return {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}


def split_hint(hint) -> tuple[Any, Optional[Range], bool]:
    """``(bare type, its Range or None, whether None is allowed)`` of a field's hint: ``Optional`` and
    ``Annotated`` taken off (a union of several types other than None comes back whole).

    >>> hint, rng, optional = split_hint(Optional[PositiveInt])
    >>> hint, str(rng), optional
    (<class 'int'>, '>= 1', True)
    """
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not _NONE]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) == 1:
            hint = args[0]
    rng = None
    if typing.get_origin(hint) is Annotated:
        rng = next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
        hint = hint.__origin__
    return hint, rng, optional


def check_value(hint, value: Any, path: str) -> Any:
    """``value`` checked against a field's type hint (module docstring); returns the value to store (a
    float for a float field, a tuple for a tuple field). A refusal is one ``ValueError`` naming ``path``.

    PyYAML 1.1 reads ``1e-6`` (no dot) as a string, so ``float`` also takes numeric strings; ``int``
    refuses bools (YAML ``yes``) and strings; ``bool`` takes only bools; ``float`` refuses ``inf`` and
    ``nan`` (YAML ``.inf``, or the strings): no field of a recipe means anything at infinity.

    >>> check_value(float, "1e-6", "optim.lr"), check_value(float, 3, "optim.lr")
    (1e-06, 3.0)
    >>> check_value(int, True, "train.steps")
    Traceback (most recent call last):
    ...
    ValueError: train.steps must be an int, got True (bool)
    >>> check_value(float, "inf", "optim.lr")
    Traceback (most recent call last):
    ...
    ValueError: optim.lr must be a finite number, got 'inf' (str)
    """
    hint, rng, optional = split_hint(hint)
    if value is None and optional:
        return None

    def refuse(kind: str):
        return ValueError(f"{path} must be {kind}, got {value!r} ({type(value).__name__})")

    origin = typing.get_origin(hint) or hint
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build_dataclass(hint, value, path)
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in typing.get_args(hint)):
            raise refuse(f"one of {list(typing.get_args(hint))}")
        return value
    if origin in _MAPPINGS:
        return _check_mapping(hint, value, path, refuse)
    if origin in _SEQUENCES:
        return _check_sequence(hint, value, path, refuse)
    if hint is bool:
        if not isinstance(value, bool):
            raise refuse("a bool (true / false)")
    elif hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse("an int")
    elif hint is float:
        number = _finite(value, refuse)
        if rng is not None and rng.refusal(number):  # the number as given (YAML's "1e38" is a string)
            raise ValueError(f"{path} {rng.refusal(number)}, got {number if isinstance(value, str) else value!r}")
        return number
    elif hint is str:
        if not isinstance(value, str):
            raise refuse("a string")
    elif value is None and hint is not Any:
        raise refuse(f"a {getattr(hint, '__name__', hint)}")
    if rng is not None and hint is int and rng.refusal(value):
        raise ValueError(f"{path} {rng.refusal(value)}, got {value!r}")
    return value


def _finite(value: Any, refuse) -> float:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise refuse("a number") from None
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise refuse("a number")
    else:
        number = float(value)
    if not math.isfinite(number):  # nan, +-inf
        raise refuse("a finite number")
    return number


def _check_mapping(hint, value: Any, path: str, refuse) -> Any:
    """A mapping with string keys, each value checked against the value type (``Any``: unchecked)."""
    if not isinstance(value, Mapping):
        raise refuse("a mapping (key: value, ...)")
    args = typing.get_args(hint)
    for key in value:
        if not isinstance(key, str):
            raise ValueError(f"{path} must have string keys, got {key!r} ({type(key).__name__})")
    if len(args) == 2 and args[1] is not Any:
        return {k: check_value(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return value


def _check_sequence(hint, value: Any, path: str, refuse) -> Any:
    """A list (YAML ``[a, b]``; a tuple too) whose elements are checked: ``tuple[X, ...]`` / ``list[X]``
    any length, ``tuple[X, Y]`` exactly that many; a bare ``tuple`` / ``list`` leaves them unchecked."""
    if not isinstance(value, (list, tuple)):
        raise refuse("a list")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis or typing.get_origin(hint) is not tuple and len(args) == 1:
        items = [check_value(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif args:
        if len(value) != len(args):
            raise refuse(f"a list of {len(args)}")
        items = [check_value(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
    else:
        items = list(value)
    return tuple(items) if (typing.get_origin(hint) or hint) is tuple else items


check_scalar = check_value
"""The former name of :func:`check_value` (it checks more than scalars now)."""
