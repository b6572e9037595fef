"""The README and the docs against the code they describe: the recipe sections they list are the
``Recipe`` dataclass's fields, ``docs/benchmarks.md`` lists what ``benchmarks/run_all.py`` runs with the
seconds it states, the test counts of ``docs/testing.md`` add up (and the README quotes them), and every
recipe and relative link they name exists. Reads files only: no process, no network."""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re

import pytest

from megatron_credit.recipe.config import Recipe

from tests.support.paths import ROOT

DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
PAGES = [os.path.join(ROOT, "README.md"), *DOCS]


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _without_code(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (their brackets are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _without_parentheses(text: str) -> str:
    """``text`` with every parenthesised part removed, nested ones too."""
    while True:
        shorter = re.sub(r"\([^()]*\)", "", text)
        if shorter == text:
            return text
        text = shorter


def _section_names(sentence: str) -> list[str]:
    """The backticked names of a sentence that lists recipe sections, leaving out what parentheses say
    about them."""
    return re.findall(r"`(\w+)`", _without_parentheses(sentence))


RECIPE_FIELDS = [f.name for f in dataclasses.fields(Recipe)]


def test_the_helpers_read_lists_and_headings_as_github_does():
    assert _section_names("`a`, `b` (`x` and [y](z.md)), plus `c`.") == ["a", "b", "c"]
    assert _anchor("The demo (`make demo`)") == "the-demo-make-demo"
    assert _anchor("vLLM: which build runs where") == "vllm-which-build-runs-where"


@pytest.mark.parametrize("page, start", [("README.md", "A recipe is YAML with the sections"),
                                         ("docs/training.md", "- Recipe sections")])
def test_the_listed_recipe_sections_are_the_recipe_s_fields(page, start):
    text = _read(page)
    sentence = text[text.index(start):]
    sentence = sentence[:sentence.index("plus `seed`") + len("plus `seed`")]
    assert _section_names(sentence) == RECIPE_FIELDS


def _run_all():
    spec = importlib.util.spec_from_file_location("benchmarks_run_all", os.path.join(ROOT, "benchmarks", "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_page_lists_what_make_bench_runs_with_its_measured_seconds():
    run_all, text = _run_all(), _read("docs", "benchmarks.md")
    flat = " ".join(text.split())
    rows = re.findall(r"^\| `(?:python )?benchmarks/(\w+\.py)` \| (\d+|not run) \|", text, flags=re.M)
    ran = [(name, float(s)) for name, s in rows if s != "not run"]
    assert ran == list(run_all.BENCHMARKS)
    assert [name for name, s in rows if s == "not run"] == sorted(run_all.NOT_RUN)
    n, total = len(run_all.BENCHMARKS), sum(s for _, s in run_all.BENCHMARKS)
    assert f"runs the {n} benchmarks below" in flat and f"`[i/{n}]`" in flat
    assert f"{total:,.0f} s in all, about {total / 60:.0f} min" in flat
    shown = f"{' + '.join(f'{s:.0f}' for _, s in run_all.BENCHMARKS)} = {total:.0f} s."
    assert shown in flat


def _equations(text: str) -> list[tuple[list[int], int]]:
    """Every ``a + b + ... = c`` of plain integers in ``text``."""
    return [([int(t) for t in lhs.split(" + ")], int(rhs))
            for lhs, rhs in re.findall(r"(\d+(?: \+ \d+)+) = (\d+)", text)]


def _tiers() -> dict[str, int]:
    """docs/testing.md's table of tiers: name -> tests."""
    text = _read("docs", "testing.md")
    table = text[text.index("| tier | selected by | tests |"):].split("\n\n")[0]
    return {m[0]: int(m[1]) for m in re.findall(r"^\| ([^|]+?) \| [^|]+ \| (\d+) \|$", table, flags=re.M)}


def test_the_tiers_of_the_test_page_add_up_to_make_test():
    tiers = _tiers()
    assert list(tiers) == ["fast", "processes, vLLM, slow", "GPU", "all"]
    assert sum(v for k, v in tiers.items() if k != "all") == tiers["all"]


def test_every_sum_written_on_the_test_and_benchmark_pages_is_right():
    text = _read("docs", "testing.md")
    equations = _equations(text)
    tiers = _tiers()
    assert ([tiers["fast"], tiers["processes, vLLM, slow"], tiers["GPU"]], tiers["all"]) in equations
    compat = int(re.search(r"`make test-compat` runs (\d+) of these tests", text)[1])
    assert ([tiers["all"], compat], tiers["all"] + compat) in equations
    equations += _equations(_read("docs", "benchmarks.md"))
    assert len(equations) >= 4
    for terms, total in equations:
        assert sum(terms) == total, (terms, total)


def test_the_readme_quotes_the_test_page_s_counts():
    readme, tiers = _read("README.md"), _tiers()
    testing = _read("docs", "testing.md")
    assert int(re.search(r"make test-fast .*?: (\d+) tests", readme)[1]) == tiers["fast"]
    assert int(re.search(r"`make test`: (\d+) tests", readme)[1]) == tiers["all"]
    compat = int(re.search(r"`make test-compat` runs (\d+) of these tests", testing)[1])
    assert int(re.search(r"which runs (\d+) megatron-facing tests", readme)[1]) == compat


def test_every_recipe_the_pages_name_exists():
    named = set()
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        named |= {(_rel(page), p) for p in re.findall(r"(?<![\w/])(examples/[\w/-]+\.(?:yaml|sh))\b", text)}
        # a recipe named without its folder, as in the README's algorithm table: `grpo_qwen25_7b.yaml`
        named |= {(_rel(page), f"examples/{p}") for p in re.findall(r"`(\w+_\w+\.yaml)`", text)}
    assert {"examples/grpo_qwen25_1p5b_smoke.yaml", "examples/fipo_qwen25_32b.yaml"} <= {p for _, p in named}
    missing = sorted((page, p) for page, p in named if not os.path.isfile(os.path.join(ROOT, p)))
    assert missing == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_of_the_readme_and_the_docs_points_at_a_file_that_exists():
    checked, broken = 0, []
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            text = _without_code(f.read())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            checked += 1
            if not os.path.exists(file):
                broken.append(f"{_rel(page)}: {target} (no such file)")
            elif anchor and file.endswith(".md") and anchor not in _anchors(file):
                broken.append(f"{_rel(page)}: {target} (no such heading)")
    assert checked > 50 and broken == []


def test_the_readme_links_the_data_and_cluster_pages():
    readme = _read("README.md")
    assert "[docs/data.md](docs/data.md)" in readme and "`mc-prepare-data`" in readme
    assert "[docs/cluster_quickstart.md](docs/cluster_quickstart.md)" in readme
    assert "FIPO-32B on 4 Slurm nodes" in readme
