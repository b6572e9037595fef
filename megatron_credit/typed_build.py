"""Plain mappings (parsed YAML) -> keyword-only dataclasses, with every value checked against its field's
type hint. Standard library only: the recipe sections (``config``, ``training_config``) and the
algorithms' parameter dataclasses (``algorithms``) are all built here, so none of them imports another
to build.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True, kw_only=True)
... class Knobs:
...     lr: float = 1.0
>>> build_dataclass(Knobs, {"lr": "1e-6"}, "optim")
Knobs(lr=1e-06)
>>> build_dataclass(Knobs, {"lrr": 1}, "optim")
Traceback (most recent call last):
...
ValueError: unknown field(s) ['lrr'] in optim; valid: ['lr']
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Mapping


def build_dataclass(cls, data: Mapping[str, Any], where: str):
    """Build dataclass ``cls`` from ``data``, recursing into dataclass-typed fields; unknown keys fail."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'recipe'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
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
            kwargs[key] = check_scalar(hint, value, path)
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


def check_scalar(hint, value: Any, path: str) -> Any:
    """``value`` checked against a scalar type hint (``int``, ``float``, ``bool``, ``str``, or one of
    them ``Optional``); other hints pass ``value`` through. Returns the value to store.

    PyYAML 1.1 reads ``1e-6`` (no dot) as a string, so ``float`` also takes numeric strings; ``int``
    refuses bools (YAML ``yes``) and strings; ``bool`` takes only bools; ``float`` refuses ``inf`` and
    ``nan`` (YAML ``.inf``, or the strings): no field of a recipe means anything at infinity.

    >>> check_scalar(float, "1e-6", "optim.lr"), check_scalar(float, 3, "optim.lr")
    (1e-06, 3.0)
    >>> check_scalar(int, True, "train.steps")
    Traceback (most recent call last):
    ...
    ValueError: train.steps must be an int, got True (bool)
    >>> check_scalar(float, "inf", "optim.lr")
    Traceback (most recent call last):
    ...
    ValueError: optim.lr must be a finite number, got 'inf' (str)
    """
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) != 1:
            return value
        hint = args[0]

    def refuse(kind: str):
        return ValueError(f"{path} must be {kind}, got {value!r} ({type(value).__name__})")

    if hint is bool:
        if not isinstance(value, bool):
            raise refuse("a bool (true / false)")
    elif hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse("an int")
    elif hint is float:
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise refuse("a number") from None
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise refuse("a number")
        else:
            number = float(value)
        if number != number or number in (float("inf"), float("-inf")):  # nan, +-inf
            raise refuse("a finite number")
        return number
    elif hint is str:
        if not isinstance(value, str):
            raise refuse("a string")
    return value
