"""``--plugin FILE.py|MODULE``: code a user registers (an algorithm, a gate control, a critic kind) before
the recipe is read.

A plugin is imported once per process (on every torchrun rank, each of which parses the same command
line). A ``.py`` path is loaded as the module ``megatron_credit_plugin_<stem>`` (registered in
``sys.modules`` first, as dataclasses need); anything else is imported by name. Not found is one line
naming the flag's value; an error raised by the plugin's own code keeps its traceback (it is the plugin's
bug, not bad input).

>>> load_plugins(["no_such_plugin_module_xyz"])
Traceback (most recent call last):
...
ValueError: --plugin no_such_plugin_module_xyz: no such file, and no module of that name can be imported
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Iterable


PLUGIN_MODULE_PREFIX = "megatron_credit_plugin_"
"""The module name of a plugin loaded from a ``.py`` path is this prefix and the file's stem."""


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin (a ``.py`` file or a module name) and return its module."""
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--plugin {spec}: no such file")
        name = PLUGIN_MODULE_PREFIX + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        if exc.name != spec and not spec.startswith(f"{exc.name}."):
            raise  # the plugin itself imports something missing: its traceback says what
        raise ValueError(f"--plugin {spec}: no such file, and no module of that name can be imported") from None


def load_plugins(specs: Iterable[str]) -> list[ModuleType]:
    """:func:`load_plugin` of each, in order."""
    return [load_plugin(s) for s in specs]
