"""Every field of the recipe refuses a value of the wrong kind when the recipe loads, in one line naming it.

The fields are found here by walking the recipe's dataclass tree (``dataclasses.fields`` from ``Recipe``
down, and each built-in algorithm's ``Config`` under ``algorithm.params``), so a field added anywhere in
it is covered without editing this file. Each field gets the values that are wrong for its hint: a
list, a mapping, a string, a negative number, null, inf / nan, a bool, a number just outside its
declared ``Range``, a list element of the wrong kind; every one must be a ``ValueError`` whose one line
names the field's dotted path (``warmup.batch_size``, ``checkpoint.exit_signals[0]``, ``algorithm.params.tau``).
A number field must declare its range (``typed_build.Range``), so that a new count cannot accept 0 or
-5 silently.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import re
import sys
import types
import typing
from typing import Annotated, Any, Iterator, Literal

import pytest

from megatron_credit.algorithm.catalog import ALGORITHMS
from megatron_credit.recipe.config import Recipe, recipe_from_dict, recipe_to_dict
from megatron_credit.typed_build import Range

KINDS: dict[str, Any] = {"list": [1, 2], "mapping": {"k": 1}, "string": "word", "negative": -5, "null": None,
                         "inf": float("inf"), "nan": float("nan"), "bool": True}
"""One value of each kind; ``wrong_values`` picks those a hint refuses."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One field of the tree: its dotted path, its hint, and the sections it needs around it (an
    algorithm's params need its ``algorithm.name``)."""

    path: tuple[str, ...]
    hint: Any
    default: Any
    context: tuple[tuple[str, str], ...] = ()

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def unwrap(hint) -> tuple[Any, Any, bool]:
    """``(bare hint, Range or None, None allowed)``: ``Optional`` and ``Annotated`` taken off."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else hint
    rng = None
    if typing.get_origin(hint) is Annotated:
        rng = next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
        hint = typing.get_args(hint)[0]
    return hint, rng, optional


def is_dataclass_type(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def walk(cls, prefix: tuple[str, ...], context=()) -> Iterator[Leaf]:
    """Every field of dataclass ``cls`` and of the dataclasses its fields hold, depth first."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        leaf = Leaf(prefix + (f.name,), hints[f.name], _default(f), context)
        yield leaf
        bare = unwrap(leaf.hint)[0]
        if is_dataclass_type(bare):
            yield from walk(bare, leaf.path, context)


def recipe_leaves() -> list[Leaf]:
    """The recipe's fields, and under ``algorithm.params`` those of each built-in algorithm's Config."""
    out = [leaf for leaf in walk(Recipe, ()) if leaf.path != ("algorithm", "params")]
    out.append(next(leaf for leaf in walk(Recipe, ()) if leaf.path == ("algorithm", "params")))
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        if cls.__module__.startswith("megatron_credit."):  # a plugin's registration (another test's) is not ours
            out += walk(cls, ("algorithm", "params"), context=(("algorithm.name", name),))
    return out


def _out_of_range(rng: Range, integer: bool) -> list:
    """Numbers just outside ``rng``, and -5 where it lies outside."""
    step = 1 if integer else 0.5
    out = [rng.ge - step if rng.ge is not None else None, rng.gt, rng.le + step if rng.le is not None else None,
           rng.lt, -5]
    return [v for v in dict.fromkeys(out) if v is not None and rng.refusal(v) is not None]


def wrong_values(hint) -> list[tuple[str, Any]]:
    """``(kind, value)`` pairs that ``hint`` refuses (a list element's are nested under ``[0]``)."""
    bare, rng, optional = unwrap(hint)
    origin = typing.get_origin(bare) or bare
    not_null = [] if optional else [("null", None)]
    if bare is bool:
        kinds = ["list", "mapping", "string", "negative", "inf"]
    elif bare is int:
        kinds = ["list", "mapping", "string", "inf", "nan", "bool"]
        return ([(k, KINDS[k]) for k in kinds] + not_null + [("fraction", 2.5)]
                + [("out of range", v) for v in _out_of_range(rng, True)] if rng else [])
    elif bare is float:
        kinds = ["list", "mapping", "string", "inf", "nan", "bool"]
        return ([(k, KINDS[k]) for k in kinds] + not_null + [("-inf", float("-inf")), ("nan string", "nan")]
                + [("out of range", v) for v in _out_of_range(rng, False)] if rng else [])
    elif bare is str:
        kinds = ["list", "mapping", "negative", "inf", "bool"]
    elif origin is Literal:
        kinds = ["list", "mapping", "negative", "inf", "bool"]
        not_null.append(("not a choice", "no_such_choice"))
    elif origin in (dict, collections.abc.Mapping):
        kinds = ["list", "string", "negative", "inf", "bool"]
        not_null.append(("integer key", {5: 1}))
    elif origin in (tuple, list, collections.abc.Sequence):
        kinds = ["mapping", "string", "negative", "inf", "bool"]
        not_null += _element_values(bare)
    elif is_dataclass_type(bare):
        kinds = ["list", "string", "negative", "inf", "bool"]
    else:
        raise AssertionError(f"no wrong values known for the hint {hint!r}: teach wrong_values")
    return [(k, KINDS[k]) for k in kinds] + not_null


def _element_values(hint) -> list[tuple[str, Any]]:
    args = typing.get_args(hint)
    if not args:
        return []
    if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
        return [(f"[0] {kind}", [value]) for kind, value in wrong_values(args[0])]
    good = [1.0] * len(args)  # a fixed-length tuple: one element wrong at a time, and a wrong length
    out = [("wrong length", good + [1.0])]
    for kind, value in wrong_values(args[0]):
        out.append((f"[0] {kind}", [value] + good[1:]))
    return out


def _recipe_data(leaf: Leaf, value: Any) -> dict:
    """The default recipe as plain data (a whole YAML file's worth), with ``leaf``'s context and ``value``
    at ``leaf.path``."""
    data = copy.deepcopy(DEFAULTS)
    for dotted, v in leaf.context:
        _set(data, tuple(dotted.split(".")), v)
    _set(data, leaf.path, value)
    return data


def _set(data: dict, path: tuple[str, ...], value: Any) -> None:
    node = data
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def _names(message: str, dotted: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(dotted)}(?![\w])", message) is not None


DEFAULTS = recipe_to_dict(Recipe())
LEAVES = recipe_leaves()
SECTIONS = sorted({leaf.path[0] for leaf in LEAVES})


def test_the_walk_finds_every_section_and_the_nested_fields():
    top = {f.name for f in dataclasses.fields(Recipe)}
    assert set(SECTIONS) == top
    dotted = {leaf.dotted for leaf in LEAVES}
    for path in ("checkpoint.exit_signals", "rollout.ranks", "rollout.engine_options", "model.architecture", "algorithm.params",
                 "warmup.batch_size", "optim.beta1", "algorithm.params.tau",
                 "algorithm.params.phase_thresholds.clipfrac", "seed"):
        assert path in dotted
    assert {name for _, name in (c[0] for leaf in LEAVES for c in [leaf.context] if c)} >= {"fipo", "comppo"}


def test_every_number_field_declares_its_range():
    missing = [leaf.dotted for leaf in LEAVES
               if unwrap(leaf.hint)[0] in (int, float) and unwrap(leaf.hint)[1] is None]
    assert missing == [], ("declare the range of these fields in their hint, e.g. Annotated[int, Range(ge=1)] "
                           f"or typed_build.PositiveInt (typed_build.AnyFloat where any number goes): {missing}")


def test_every_default_loads_when_given_explicitly():
    """The walk's paths are the recipe's: each default (an algorithm Config's under ``algorithm.params``),
    given at its path, loads; so the refusals below are the value's, not the path's."""
    for leaf in LEAVES:
        value = leaf.default
        if not leaf.context:
            value = DEFAULTS
            for key in leaf.path:
                value = value[key]
        elif dataclasses.is_dataclass(value):
            value = recipe_to_dict(value)
        value = list(value) if isinstance(value, tuple) else value
        assert recipe_from_dict(_recipe_data(leaf, value)) is not None, leaf.dotted


@pytest.mark.parametrize("section", SECTIONS)
def test_every_field_refuses_every_wrong_kind_in_one_line_naming_it(section, capsys):
    tried, failures = 0, []
    leaves = [leaf for leaf in LEAVES if leaf.path[0] == section]
    for leaf in leaves:
        for kind, value in wrong_values(leaf.hint):
            tried += 1
            try:
                recipe_from_dict(_recipe_data(leaf, value))
            except ValueError as exc:
                message = str(exc)
                if not _names(message, leaf.dotted) or "\n" in message:
                    failures.append(f"{leaf.dotted} = {value!r} ({kind}): the line does not name it: {message}")
            except Exception as exc:  # noqa: BLE001  (a traceback for the user: the failure this test is for)
                failures.append(f"{leaf.dotted} = {value!r} ({kind}): {type(exc).__name__}: {exc}")
            else:
                failures.append(f"{leaf.dotted} = {value!r} ({kind}): accepted")
    with capsys.disabled():
        sys.stdout.write(f"\n[{section}: {len(leaves)} fields, {tried} wrong values]")
    assert failures == [], "\n".join(failures)
    assert tried >= len(leaves)


@pytest.mark.dist
def test_the_trainer_command_prints_the_one_line_and_exits_2(tmp_path):
    """The same refusal through ``pretrain_rl.py``: one ``error:`` line on stderr, exit 2, nothing built."""
    from tests.support.runs import run_pretrain_rl

    proc = run_pretrain_rl("--config", "examples/demo_cpu.yaml", "--output-dir", tmp_path / "run", "checkpoint.exit_signals=1",
                           timeout=300)
    assert (proc.returncode, proc.stderr) == (2, "error: checkpoint.exit_signals must be a list, got 1 (int)\n"), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
