"""Print the README's table of the GPU recipes from the recipes and the planner themselves.

    python tools/recipe_table.py            # the table (markdown)
    python tools/recipe_table.py --write    # replace the table in README.md, between its two markers

One row per ``examples/<recipe>.sh`` that downloads a model (``MODEL_ID=``): the model it downloads, the
algorithm and rollout mode (with a pool: which side waits for the other, for what share of an iteration), the
recipe's cluster (``cluster`` section) and layout, and the planner's
estimates on that cluster (``megatron_credit.planning.timing``: the same figures ``tools/plan.py`` prints),
per iteration, for ``train.steps`` iterations with their saves, per save and for the checkpoints kept on
disk. A test checks that README.md holds this output, so the table cannot drift from the recipes.
"""
from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "<!-- recipe table: tools/recipe_table.py -->"
END = "<!-- end of recipe table -->"
MODEL_ID = re.compile(r"\bMODEL_ID=(\S+)")


def gpu_recipes() -> list[tuple[str, str]]:
    """``(recipe stem, hub id)`` of every recipe script that downloads a model, sorted by name."""
    out = []
    for script in sorted(glob.glob(os.path.join(ROOT, "examples", "*.sh"))):
        with open(script, encoding="utf-8") as f:
            found = MODEL_ID.search(f.read())
        if found:
            out.append((os.path.splitext(os.path.basename(script))[0], found.group(1)))
    return out


def _duration(seconds: float) -> str:
    from megatron_credit.planning.timing import _duration as duration

    return duration(seconds)


def row(name: str, model_id: str) -> str:
    """One recipe's row of the table."""
    from megatron_credit.gpu_kinds import GIB
    from megatron_credit.planning.plan import resolve_hf_config
    from megatron_credit.planning.report import launch_report
    from megatron_credit.recipe.config import load_recipe

    recipe = load_recipe(os.path.join(ROOT, "examples", f"{name}.yaml"))
    c, p, r = recipe.cluster, recipe.parallel, recipe.rollout
    report = launch_report(recipe, resolve_hf_config(recipe.model), nodes=c.nodes, gpus_per_node=c.gpus_per_node,
                           gpu=c.gpu, title=name)
    e = report.estimate
    layout = f"TP {p.tensor_model_parallel_size} PP {p.pipeline_model_parallel_size} CP {p.context_parallel_size}"
    mode = r.mode + (f", pool of {r.ranks}" if r.ranks else "")
    return (f"| [{name}](examples/{name}.yaml) | {recipe.algorithm.name} | `{model_id}` | {c.nodes} x {c.gpus_per_node} "
            f"{c.gpu} | {layout} | {mode} | {waits(e)} | {_duration(e.iteration_s)} | {recipe.train.steps}: {_duration(e.run_s)} | "
            f"{e.checkpoint_bytes / GIB:,.0f} GiB | {e.disk_bytes / GIB:,.0f} GiB |")


def waits(estimate) -> str:
    """The balance of a pool recipe: which side waits for the other, and for what share of an iteration
    (``-`` in sync, where generation and training take turns)."""
    trainer, pool = estimate.idle_fracs()
    if not estimate.overlapped:
        return "-"
    return f"trainer {100 * trainer:.0f}%" if trainer >= pool else f"pool {100 * pool:.0f}%"


def table() -> str:
    """The whole table, between its markers."""
    head = ["| recipe | algorithm | model (downloaded by its .sh) | cluster | layout | rollout | waits (est.) | "
            "one iteration (est.) | train.steps: the run (est.) | one save | checkpoints on disk (kept + one) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    return "\n".join([BEGIN, *head, *(row(n, m) for n, m in gpu_recipes()), END])


def write_readme(path: str = os.path.join(ROOT, "README.md")) -> None:
    """Replace the table between the markers of ``path`` (or the lone first marker) with :func:`table`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index(BEGIN)
    end = text.index(END, start) + len(END) if END in text else start + len(BEGIN)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + table() + text[end:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        write_readme()
    elif argv:
        print("usage: python tools/recipe_table.py [--write]", file=sys.stderr)
        return 2
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
