"""How entry points end: one line ``error: ...`` and exit code 2 for a user's mistake, a traceback for ours.

A user error is bad input the user can fix: a ``ValueError`` (the project raises it, or a subclass such
as ``DatasetFormatError`` / ``CheckpointFormatError``, for every refused input and names what to
change), a missing or existing file or folder, a permission problem, a YAML syntax error. Anything
else (``AssertionError``, ``RuntimeError``, ``KeyError``, ...) is a bug and keeps its traceback.
``--debug`` shows the traceback of user errors too.

Known harmless warnings of megatron-core and torch (:data:`KNOWN_HARMLESS_WARNINGS`: no Transformer
Engine / Apex on a CPU machine, deprecations inside megatron's own calls) are filtered once here, so
that an entry point's output shows what matters; ``--debug`` shows them again.

>>> def main(argv):
...     raise FileNotFoundError("no config.json in '/models/x'")
>>> run_main(main, [])  # prints "error: no config.json in '/models/x'" on stderr
2
>>> error_line(ValueError("model.architecture: unknown key\\n'hidden_sizee'"))
"error: model.architecture: unknown key 'hidden_sizee'"
"""
from __future__ import annotations

import argparse
import errno
import math
import sys
import warnings
from typing import Callable, Sequence

from megatron_credit.typed_build import Range


class RunStopped(RuntimeError):
    """A run that stops for a reason one line states (a helper process that died, a wait past its timeout)."""


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, RunStopped, FileNotFoundError, FileExistsError,
                                                 NotADirectoryError, IsADirectoryError, PermissionError)
"""Exceptions reported as one line (``ValueError`` includes its subclasses, e.g. ``UnicodeDecodeError``)."""

USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""``OSError`` codes reported as one line too (``[Errno 28] No space left on device: '...'``)."""

USER_ERROR_EXIT_CODE = 2
DEBUG_FLAG = "--debug"

KNOWN_HARMLESS_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, "Transformer Engine and Apex are not installed"),  # megatron on CPU: local fallbacks
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),  # megatron on CPU: torch norms
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope"),  # megatron's own default
    (FutureWarning, "`load_state_dict` is deprecated"),  # torch, called by megatron's torch_dist loader
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),  # same
)
"""``(category, start of the message)`` of warnings every CPU run of megatron-core prints and that ask
nothing of the user."""


def filter_known_warnings() -> None:
    """Ignore :data:`KNOWN_HARMLESS_WARNINGS` from now on (process-wide: call it from a ``main``)."""
    import re

    for category, message in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


def _user_errors() -> tuple[type[BaseException], ...]:
    errors = USER_ERRORS
    if "yaml" in sys.modules:  # a recipe with a syntax error; yaml is imported only by who reads YAML
        errors += (sys.modules["yaml"].YAMLError,)
    return errors


def error_line(exc: BaseException) -> str:
    """The one line shown for a user error: ``error: <message>`` (newlines folded, never empty)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return f"error: {message}"


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv`` default ``sys.argv[1:]``), turning user errors into ``error: ...`` on
    stderr and exit code 2, with the known harmless warnings filtered. ``--debug`` anywhere in ``argv``
    is removed before ``main`` sees it, makes user errors raise with their traceback and keeps every
    warning. Returns ``main``'s exit code (None counts as 0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [a for a in args if a != DEBUG_FLAG]
    if not debug:
        filter_known_warnings()
    try:
        code = main(args)
    except _user_errors() as exc:
        if debug:
            raise
        print(error_line(exc), file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except OSError as exc:  # a full disk or a read-only folder is the user's to fix, not a bug
        if debug or exc.errno not in USER_ERRNOS:
            raise
        print(error_line(exc), file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0 if code is None else int(code)


def ranged(kind: type, rng: Range) -> Callable[[str], float]:
    """An argparse ``type=`` reading an ``int`` or a finite ``float`` inside ``rng``; argparse turns its
    refusal into usage plus one line naming the option, exit 2 (``argument --k: must be >= 1, got '0'``).
    The returned function carries ``kind`` and ``range`` (the tests walk every option by them).

    >>> ranged(int, Range(ge=1))("3")
    3
    >>> ranged(float, Range(gt=0))("inf")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number, got 'inf'
    """
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        why = rng.refusal(value)
        if why:
            raise argparse.ArgumentTypeError(f"{why}, got {text!r}")
        return value

    parse.kind, parse.range = kind, rng
    parse.__name__ = f"{kind.__name__} {rng}"
    return parse


positive_int = ranged(int, Range(ge=1))
"""A size or a count given on a command line: 0 means nothing."""
nonnegative_int = ranged(int, Range(ge=0))
"""A count whose 0 means off (``--reward-workers 0``: in-process), or a seed."""
positive_float = ranged(float, Range(gt=0))
"""A temperature, a rate."""
