"""The recipe is the house's ground floor of configuration: it imports no code that runs a rollout or a
training step, so a recipe is loaded and checked without them (``docs/architecture.md``).

Read with ``ast`` (nothing is imported but ``megatron_credit.sources`` at the end): every import of a
module under ``megatron_credit/recipe/``, at module level or inside a function, names ``megatron_credit.recipe``
or one of ``ALLOWED``, and no module that those import, followed import by import, is of ``FORBIDDEN``. The
allowed set is what the recipe's checks read, each below the recipe:

- ``typed_build``, ``registry``, ``seed_modes``: the typed loading, the name registries, the seed-mode names;
- ``families``, ``models``: a model family's supported types and architecture keys, the model's rope
  settings and layout checks (``ModelConfig``, ``Recipe.problems``);
- ``data``: the synthetic chain's own config check (``DataConfig``);
- ``algorithm``, ``losses``: the algorithm catalogue and the KL estimators (``AlgorithmConfig``);
- ``env``: the environments' registry (``EnvConfig``, ``recipe/env_section.py``);
- ``gpu_kinds``: the GPU names ``cluster.gpu`` is checked against (standard library only; the planner reads
  the same table, above the recipe).
The rollout modes' facts are the recipe's own (``recipe/rollout_modes.py``); the sources that serve them
(``megatron_credit.sources``), the engines (``megatron_credit.rollout``) and the trainer sit above it.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_credit"
ALLOWED = {"recipe", "typed_build", "registry", "seed_modes", "families", "models", "data", "algorithm", "losses",
           "env", "gpu_kinds"}
ALLOWED_MODULES: dict[str, set[str]] = {}
FORBIDDEN = {"trainer", "sources", "rollout"}


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """The ``megatron_credit`` modules ``path`` imports anywhere, with the packages Python runs on the way."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "megatron_credit":
                continue
            for i in range(2, len(parts) + 1):
                if _module_file(".".join(parts[:i])):
                    out.add(".".join(parts[:i]))
    return out


def test_the_recipe_imports_only_what_lies_below_it():
    bad, reached, todo = [], set(), []
    for path in sorted((PACKAGE / "recipe").rglob("*.py")):
        for name in _imports(path):
            pkg = name.split(".")[1]
            allowed = ALLOWED_MODULES.get(pkg)
            if pkg not in ALLOWED or (allowed is not None and name not in allowed and name != f"megatron_credit.{pkg}"):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            todo.append(name)
    while todo:  # what the allowed imports import in turn
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo.extend(_imports(_module_file(name)))
    bad += sorted(f"the recipe reaches {name}" for name in reached if name.split(".")[1] in FORBIDDEN)
    assert not bad, bad


def test_the_rollout_sources_are_a_package_beside_the_trainer():
    assert not (PACKAGE / "trainer" / "sources").exists()
    sources = importlib.import_module("megatron_credit.sources")
    from megatron_credit.recipe.rollout_modes import ROLLOUT_MODES

    assert sources.ROLLOUT_SOURCES.names() == ROLLOUT_MODES.names()  # every mode is served, by its own facts
    assert all(issubclass(sources.ROLLOUT_SOURCES.get(m), ROLLOUT_MODES.get(m)) for m in ROLLOUT_MODES)
