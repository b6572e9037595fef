"""Print the mutation score of the last ``mutmut run`` (``make mutation``): per module and in total.

Reads mutmut's result files (``mutants/<source path>.meta``, JSON with an exit code per mutant) and
``mutation_equivalents.md`` (mutants no test can kill, each named in backticks in a table row), and
prints for each mutated module: killed / checked, the mutants no selected test reached ("no tests":
code that runs only in gloo workers or subprocesses, which mutmut cannot trace), the survivors, and
the score over non-equivalent mutants. Exit status 0; the score is a number to read and move, not a gate.

Mutant names are mutmut 3's: ``megatron_credit.credit.future_kl.x_future_kl__mutmut_12`` (module,
``x_`` + function, or ``xǁClassǁmethod``, then the mutant's index in that function); ``mutmut show
NAME`` prints its diff. Indices shift when a function changes, so re-check the equivalents list then.

>>> _status(1), _status(0), _status(None), _status(36)
('killed', 'survived', 'not checked', 'timeout')
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "mutation_equivalents.md"

# mutmut's exit-code meanings (mutmut/stats.py); timeouts and crashes count as kills, as mutmut does.
_KILLED = {1, 3, 36, -24, 24, 152, 255, -11, -9}
_NAMES = {0: "survived", None: "not checked", 5: "no tests", 33: "no tests", 34: "skipped", 37: "type check"}


def _status(code: int | None) -> str:
    if code in _KILLED:
        return "killed" if code in (1, 3) else "timeout"
    return _NAMES.get(code, "suspicious")


def equivalent_names(path: Path = EQUIVALENTS) -> set[str]:
    """Mutant names in backticks in the table rows of the equivalents file."""
    if not path.exists():
        return set()
    names = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            names.update(re.findall(r"`([\w.ǁ]+__mutmut_\d+)`", line))
    return names


def load_results(mutants_dir: Path) -> dict[str, dict[str, int | None]]:
    """Module path (``megatron_credit/credit/scan.py``) -> {mutant name: exit code}."""
    out = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if codes:
            out[str(meta.relative_to(mutants_dir))[: -len(".meta")]] = codes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's working folder")
    p.add_argument("--all", action="store_true", help="also list modules with nothing checked")
    args = p.parse_args(argv)
    results = load_results(args.mutants)
    if not results:
        print(f"no mutmut results under {args.mutants}; run `make mutation` first")
        return 0
    equivalent = equivalent_names()
    total: dict[str, int] = defaultdict(int)
    survivors: list[str] = []
    print(f"{'module':<44} {'killed':>7} {'checked':>8} {'no tests':>9} {'equiv':>6} {'score':>7}"
          "  (score: killed / (checked - equiv))")
    for module, codes in results.items():
        st = {name: _status(code) for name, code in codes.items()}
        checked = [n for n, s in st.items() if s not in ("not checked", "skipped")]
        if not checked and not args.all:
            continue
        killed = sum(st[n] in ("killed", "timeout") for n in checked)
        equiv = sum(st[n] == "survived" and n in equivalent for n in checked)
        untested = sum(st[n] == "no tests" for n in checked)
        alive = [n for n in checked if st[n] not in ("killed", "timeout") and n not in equivalent]
        survivors += [f"{n}  ({st[n]})" for n in alive]
        denom = len(checked) - equiv
        score = f"{100 * killed / denom:.1f}%" if denom else "-"
        print(f"{module:<44} {killed:>7} {len(checked):>8} {untested:>9} {equiv:>6} {score:>7}")
        for k, v in (("killed", killed), ("checked", len(checked)), ("untested", untested), ("equiv", equiv)):
            total[k] += v
    denom = total["checked"] - total["equiv"]
    score = f"{100 * total['killed'] / denom:.1f}%" if denom else "-"
    print(f"{'TOTAL':<44} {total['killed']:>7} {total['checked']:>8} {total['untested']:>9} {total['equiv']:>6} "
          f"{score:>7}")
    print(f"\n{len(survivors)} non-equivalent survivors (`mutmut show NAME` prints the change):")
    for s in survivors:
        print("  " + s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
