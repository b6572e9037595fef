"""``docs/config_reference.md`` is what ``tools/config_reference.py`` prints: every recipe field, its default
and its docstring, so the README's config reference cannot drift from the dataclasses."""
from __future__ import annotations

import dataclasses
import os

from tests.support.paths import ROOT
from tools import config_reference



def test_the_committed_reference_is_current():
    with open(os.path.join(ROOT, "docs", "config_reference.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == config_reference.reference(), (
        "docs/config_reference.md is stale: python tools/config_reference.py > docs/config_reference.md")


def test_every_field_of_every_section_is_documented_with_its_docstring():
    from megatron_credit.recipe.config import Recipe
    from megatron_credit.recipe.sections import OptimConfig

    text = config_reference.reference()
    for section in dataclasses.fields(Recipe):
        if section.name == "seed":
            continue
        cls = type(section.default_factory())
        docs = config_reference.field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "params" and section.name == "algorithm":
                continue
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring"
            assert f"| `{section.name}.{f.name}` |" in text
    assert "| `optim.lr` | `" + repr(OptimConfig().lr) + "` |" in text  # the default is the dataclass's


def test_field_docs_reads_the_string_under_each_field_and_inherits():
    @dataclasses.dataclass
    class Base:
        a: int = 1
        """The a."""
        b: int = 2

    @dataclasses.dataclass
    class Child(Base):
        c: str = "x"
        """The
        c."""

    assert config_reference.field_docs(Child) == {"a": "The a.", "c": "The c."}
    assert config_reference.table(Child, "s.") == [
        "| field | default | meaning |", "| --- | --- | --- |", "| `s.a` | `1` | The a. |", "| `s.b` | `2` |  |",
        '| `s.c` | `"x"` | The c. |']
