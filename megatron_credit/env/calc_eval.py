"""The calculator's evaluator: arithmetic on numbers, nothing else. Runs in a sandbox worker, so it imports
the standard library only.

The expression is parsed with ``ast`` (mode ``"eval"``: one expression, never executed as code) and
walked by hand; allowed are int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and
parentheses. Anything else (names, calls, attributes, strings, comparisons, bools, complex numbers) is a
``ValueError``. Python's numbers can take unbounded time and memory (``9**9**9``), so an exponent above
64 and any intermediate integer with more than 1000 digits are refused as well; with both bounds the
largest number ever computed has about 64,000 digits (milliseconds). Arithmetic errors (division by zero,
float overflow) propagate as the evaluator's own exceptions; the sandbox turns any exception into a
failed call.

>>> evaluate("(1 + 2) * 3"), evaluate("7 / 2"), evaluate("10 / 4 * 2"), evaluate("-2 ** 3")
('9', '3.5', '5', '-8')
>>> evaluate("2 ** 65")
Traceback (most recent call last):
...
ValueError: exponent 65 is above 64
>>> evaluate("__import__('os')")
Traceback (most recent call last):
...
ValueError: Call is not allowed in a calculator expression
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Union

Number = Union[int, float]

MAX_EXPONENT = 64
"""Largest exponent of ``**`` (a bound on the cost of one power)."""
MAX_DIGITS = 1000
"""Most decimal digits of an integer, intermediate results included."""
_INT_BOUND = 10**MAX_DIGITS  # |n| >= this has more than MAX_DIGITS digits
_EXACT_FLOAT_INTS = 2**53  # floats below this in magnitude hold every integer exactly

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> str:
    """The value of the arithmetic ``expression``, formatted by :func:`format_number`; ``ValueError`` for
    anything but allowed arithmetic (module docstring), the arithmetic's own exceptions otherwise."""
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    return format_number(_value(tree.body))


def format_number(value: Number) -> str:
    """An int as its digits; a float as an int when it is integral and exact (below 2**53), else its
    shortest ``repr``: ``10 / 2`` is ``5``, ``0.1 + 0.2`` is ``0.30000000000000004``, ``1e300`` stays
    ``1e+300`` rather than 301 digits of which the last 285 are float rounding.

    >>> format_number(5.0), format_number(-0.0), format_number(2.5), format_number(1e300), format_number(12)
    ('5', '0', '2.5', '1e+300', '12')
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_FLOAT_INTS:
        return str(int(value))
    return repr(value)


def _value(node: ast.expr) -> Number:
    """The checked value of one node of the expression tree."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): bool is an int
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and right > MAX_EXPONENT:
            raise ValueError(f"exponent {format_number(right)} is above {MAX_EXPONENT}")
        return _checked(_BINARY[type(node.op)](left, right))
    what = type(node.value).__name__ if isinstance(node, ast.Constant) else type(node).__name__
    raise ValueError(f"{what} is not allowed in a calculator expression")


def _checked(value: object) -> Number:
    """``value`` if it is a finite real number of at most ``MAX_DIGITS`` digits, else ``ValueError``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= _INT_BOUND:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"result is not finite: {value}")
        return value
    raise ValueError(f"result is not a real number: {type(value).__name__}")  # (-8) ** 0.5 is complex
