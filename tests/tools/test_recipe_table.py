"""README.md's table of the GPU recipes is what ``tools/recipe_table.py`` prints, row by row from the planner:
a recipe, a launcher or an estimate that changes changes the table, or this test fails."""
from __future__ import annotations

import os

from tests.support.paths import ROOT
from tools import recipe_table


def test_the_readme_holds_the_table_the_tool_prints():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert recipe_table.table() in readme, "README.md's recipe table is stale: python tools/recipe_table.py --write"


def test_every_model_downloading_script_has_a_row_with_the_planner_s_figures():
    from megatron_credit.planning.plan import resolve_hf_config
    from megatron_credit.planning.timing import _duration, iteration_estimate
    from megatron_credit.recipe.config import load_recipe

    names = dict(recipe_table.gpu_recipes())
    assert {"fipo_qwen25_32b", "fipo_qwen25_32b_async", "fipo_qwen3_30b_a3b", "grpo_qwen25_1p5b_smoke"} <= set(names)
    assert names["fipo_qwen3_30b_a3b"] == "Qwen/Qwen3-30B-A3B-Base"  # the Base model its YAML trains
    recipe = load_recipe(os.path.join(ROOT, "examples", "fipo_qwen25_32b_async.yaml"))
    e = iteration_estimate(recipe, resolve_hf_config(recipe.model), nodes=8, gpus_per_node=8, gpu="h100-80gb")
    row = recipe_table.row("fipo_qwen25_32b_async", names["fipo_qwen25_32b_async"])
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["fipo", "`Qwen/Qwen2.5-32B`", "8 x 8 h100-80gb", "TP 8 PP 2 CP 2", "async, pool of 32"]
    assert cells[6] == f"trainer {100 * e.idle_fracs()[0]:.0f}%" == "trainer 24%"  # the pool is still the slower side
    assert cells[7] == _duration(e.iteration_s) and cells[8] == f"500: {_duration(e.run_s)}"
    assert cells[9] == f"{e.checkpoint_bytes / 2**30:,.0f} GiB" and cells[10] == f"{e.disk_bytes / 2**30:,.0f} GiB"
    sync = [c.strip() for c in recipe_table.row("fipo_qwen25_32b", names["fipo_qwen25_32b"]).strip("|").split("|")]
    assert sync[6] == "-"  # generation and training take turns
