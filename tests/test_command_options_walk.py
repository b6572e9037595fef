"""Every option of every installed command refuses a bad value in one line naming it, exit 2.

The commands are found here (every module of ``megatron_credit.commands``, and ``pretrain_rl.py``), and
their options by walking each ``build_parser()``'s actions, so a command or an option added later is
covered without editing this file. A number option must read through ``cli.ranged`` (its declared
range), so that ``--k 0`` or ``--nodes -5`` cannot pass; each gets a word, an empty string, a
fraction for an int, inf / nan, and numbers just outside its range. A size option gets sizes that are
no sizes; a choice option a name that is not a choice. Each must end in argparse's usage and one
``error: argument --opt: ...`` line, exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import pkgutil

import pytest

import megatron_credit.commands
from megatron_credit.typed_build import Range


def command_modules() -> dict:
    names = [m.name for m in pkgutil.iter_modules(megatron_credit.commands.__path__)]
    out = {name: importlib.import_module(f"megatron_credit.commands.{name}") for name in names}
    out["pretrain_rl"] = importlib.import_module("pretrain_rl")  # the repository root is on sys.path under pytest
    return out


MODULES = command_modules()


def _out_of_range(rng: Range, integer: bool) -> list[str]:
    step = 1 if integer else 0.5
    candidates = [rng.ge - step if rng.ge is not None else None, rng.gt,
                  rng.le + step if rng.le is not None else None, rng.lt, -5]
    return [str(v) for v in dict.fromkeys(candidates) if v is not None and rng.refusal(v) is not None]


def bad_values(action: argparse.Action) -> list[str]:
    """The values ``action`` must refuse, from its declared type (module docstring)."""
    kind = getattr(action.type, "kind", None)
    if action.choices is not None:
        return ["no_such_choice"]
    if kind is int:
        return ["word", "", "1.5", "inf", "nan"] + _out_of_range(action.type.range, True)
    if kind is float:
        return ["word", "", "inf", "-inf", "nan"] + _out_of_range(action.type.range, False)
    if kind == "size":
        return ["word", "", "-5", "0", "5XB"]
    return []


def typed_actions():
    for name, module in MODULES.items():
        for action in module.build_parser()._actions:
            if action.type is not None or action.choices is not None:
                yield name, action


def test_every_command_has_a_parser_to_walk():
    assert set(MODULES) >= {"plan", "convert_hf_to_megatron", "convert_megatron_to_hf", "evaluate",
                            "export_run_to_hf", "import_gguf", "pretrain_rl"}
    for module in MODULES.values():
        assert isinstance(module.build_parser(), argparse.ArgumentParser)
    assert {(n, a.dest) for n, a in typed_actions()} >= {("plan", "nodes"), ("evaluate", "k"),
                                                         ("convert_megatron_to_hf", "max_shard_size")}


def test_every_number_option_declares_its_range():
    bare = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, a in typed_actions()
            if a.type in (int, float) or (a.type is not None and a.choices is None and not bad_values(a))]
    assert bare == [], f"read these through megatron_credit.cli.ranged (a declared Range): {bare}"


def test_every_option_refuses_its_bad_values_in_one_line_naming_it(capsys):
    tried, failures = 0, []
    for name, action in typed_actions():
        option = "/".join(action.option_strings) or action.dest
        for value in bad_values(action):
            tried += 1
            err = io.StringIO()
            argv = [action.option_strings[0], value] if action.option_strings else [value]
            with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
                MODULES[name].build_parser().parse_args(argv)
            lines = [line for line in err.getvalue().splitlines() if "error:" in line]
            if exit_info.value.code != 2 or len(lines) != 1 or f"argument {option}:" not in lines[0]:
                failures.append(f"{name} {option} {value!r}: exit {exit_info.value.code}, {err.getvalue()!r}")
    with capsys.disabled():
        print(f"\n[{len(MODULES)} commands, {len(list(typed_actions()))} typed options, {tried} bad values]")
    assert failures == [], "\n".join(failures)


def test_good_values_still_parse():
    args = MODULES["evaluate"].build_parser().parse_args(
        ["--hf-dir", "m", "--data", "d.jsonl", "--k", "4", "--pass-k", "1", "2", "--top-p", "1", "--top-k", "0",
         "--temperature", "0.7", "--seed", "0", "--reward-workers", "0"])
    assert (args.k, args.pass_k, args.top_p, args.top_k, args.temperature, args.seed) == (4, [1, 2], 1.0, 0, 0.7, 0)
    plan = MODULES["plan"].build_parser().parse_args(["--config", "r.yaml", "--nodes", "2", "--gpus-per-node", "8"])
    assert (plan.nodes, plan.gpus_per_node) == (2, 8)
    size = MODULES["convert_megatron_to_hf"].build_parser().parse_args(["--ckpt", "c", "--out", "o",
                                                                        "--max-shard-size", "1KiB"])
    assert size.max_shard_size == 1024
