"""Every ``.md`` document the code cites is in the repository (``docs/architecture.md`` holds the design the
modules cite): a docstring or comment that points outside it points at nothing for a reader."""
from __future__ import annotations

import re
from pathlib import Path

from tests.support.paths import ROOT

CITED = re.compile(r"([A-Za-z0-9_./-]+\.md)\b")


def test_every_markdown_file_the_code_cites_exists():
    root = Path(ROOT)
    missing = []
    for folder in ("megatron_credit", "tests", "tools", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            for name in set(CITED.findall(path.read_text(encoding="utf-8"))):
                head = name.split("/")[0]
                if ("/" not in name and not name[:-3].isupper() and name != "architecture.md") or head.isupper() \
                        or head == "runs":
                    continue  # a file a program writes (report.md, OUT/results.md, runs/...), not a citation
                if not any((base / name).is_file() for base in (root, root / "docs", path.parent)):
                    missing.append(f"{path.relative_to(root)}: {name}")
    assert missing == [], missing
