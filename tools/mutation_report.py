"""Print the mutation score of the last ``mutmut run`` (``make mutation``): per module and in total.

Reads mutmut's result files (``mutants/<source path>.meta``, JSON with an exit code per mutant) and
``mutation_equivalents.md`` (mutants no test can kill, each named in backticks in a table row), and
prints for each mutated module: mutants with a verdict, killed, timed out, suspicious (a crash or an
unknown exit code), "no tests" (no selected test reached the code: it runs only in gloo workers or
subprocesses, which mutmut cannot trace), survivors, equivalents, and the score.

The score is ``killed / (verdicts - equivalent)``. Only a failing test is a kill: a timeout is counted
and listed on its own, not as a kill (mutmut's own summary counts it as one), because a mutant that
merely runs slower than mutmut's CPU limit on a loaded machine says nothing about the tests; re-run
timeouts with a larger ``timeout_multiplier`` and see whether they are killed or survive. Exit status 0;
the score is a number to read and move, not a gate.

Mutant names are mutmut 3's: ``megatron_credit.credit.future_kl.x_future_kl__mutmut_12`` (module,
``x_`` + function, or ``xǁClassǁmethod``, then the mutant's index in that function); ``mutmut show
NAME`` prints its diff. Indices shift when a function changes, so re-check the equivalents list then.

>>> _status(1), _status(0), _status(None), _status(36), _status(-11), _status(99)
('killed', 'survived', 'not checked', 'timeout', 'suspicious', 'suspicious')
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "mutation_equivalents.md"

# mutmut's exit codes (mutmut/stats.py, 3.8). 1 and 3: a test failed, or pytest errored on the mutant;
# 37: the type checker rejected the mutant (also a detection). 36 and the SIGXCPU codes: over the CPU
# limit. Segfaults (-11), SIGKILL (-9, also what follows SIGXCPU when a child ignores it) and codes mutmut
# does not know are "suspicious": neither a kill nor a survivor until someone looks.
_NAMES = {1: "killed", 3: "killed", 37: "killed", 0: "survived", None: "not checked", 5: "no tests",
          33: "no tests", 34: "skipped", 2: "not checked", 36: "timeout", -24: "timeout", 24: "timeout",
          152: "timeout", 255: "timeout"}
# Statuses that are not a verdict on the tests: left out of every count.
_NO_VERDICT = ("not checked", "skipped")


def _status(code: int | None) -> str:
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
            out[meta.relative_to(mutants_dir).as_posix()[: -len(".meta")]] = codes
    return out


@dataclass
class ModuleScore:
    """Counts of one module's mutants with a verdict; ``names`` lists the ones someone must look at."""

    module: str
    verdicts: int = 0
    killed: int = 0
    timeout: int = 0
    suspicious: int = 0
    no_tests: int = 0
    survived: int = 0
    equivalent: int = 0
    names: dict[str, list[str]] = field(default_factory=lambda: {"survived": [], "no tests": [],
                                                                 "timeout": [], "suspicious": []})
    # Listed as equivalent but now killed or changed: the equivalents file needs a look.
    stale_equivalents: list[str] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        """Killed over non-equivalent verdicts, in [0, 1]; None if there is nothing to score."""
        denom = self.verdicts - self.equivalent
        return self.killed / denom if denom else None


def score_module(module: str, codes: dict[str, int | None], equivalent: set[str]) -> ModuleScore:
    """Score one module's ``{mutant name: exit code}``; only survivors can be equivalent."""
    s = ModuleScore(module)
    for name, code in sorted(codes.items()):
        st = _status(code)
        if st in _NO_VERDICT:
            continue
        s.verdicts += 1
        if st == "survived" and name in equivalent:
            s.equivalent += 1
            continue
        if name in equivalent:
            s.stale_equivalents.append(f"{name}  ({st})")
        if st == "killed":
            s.killed += 1
        else:
            setattr(s, st.replace(" ", "_"), getattr(s, st.replace(" ", "_")) + 1)
            s.names[st].append(name)
    return s


def _fmt(score: float | None) -> str:
    return f"{100 * score:.1f}%" if score is not None else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's working folder")
    p.add_argument("--equivalents", type=Path, default=EQUIVALENTS, help="the equivalent mutants' table")
    p.add_argument("--all", action="store_true", help="also list modules with nothing checked")
    args = p.parse_args(argv)
    results = load_results(args.mutants)
    if not results:
        print(f"no mutmut results under {args.mutants}; run `make mutation` first")
        return 0
    equivalent = equivalent_names(args.equivalents)
    cols = ("verdicts", "killed", "timeout", "suspicious", "no_tests", "survived", "equivalent")
    heads = ("mutants", "killed", "timeout", "suspic.", "no tests", "survived", "equiv")
    print(f"{'module':<44} " + " ".join(f"{h:>8}" for h in heads) + f" {'score':>7}"
          "\n(score: killed / (mutants - equiv); timeouts, suspicious and no-tests mutants are not kills)")
    total = ModuleScore("TOTAL")
    for module, codes in results.items():
        s = score_module(module, codes, equivalent)
        if not s.verdicts and not args.all:
            continue
        print(f"{module:<44} " + " ".join(f"{getattr(s, c):>8}" for c in cols) + f" {_fmt(s.score):>7}")
        for c in cols:
            setattr(total, c, getattr(total, c) + getattr(s, c))
        for k, v in s.names.items():
            total.names[k] += v
        total.stale_equivalents += s.stale_equivalents
    print(f"{'TOTAL':<44} " + " ".join(f"{getattr(total, c):>8}" for c in cols) + f" {_fmt(total.score):>7}")
    for status in ("survived", "timeout", "suspicious"):
        names = total.names[status]
        if names:
            print(f"\n{len(names)} {status} (`mutmut show NAME` prints the change):")
            print("\n".join("  " + n for n in names))
    if total.names["no tests"]:
        # Whole functions at a time (code run only by gloo workers): one line per function.
        per_fn: dict[str, int] = {}
        for n in total.names["no tests"]:
            fn = n.rsplit("__mutmut_", 1)[0]
            per_fn[fn] = per_fn.get(fn, 0) + 1
        print(f"\n{len(total.names['no tests'])} no tests (no selected test reached the function in-process):")
        print("\n".join(f"  {fn}  ({k} mutants)" for fn, k in per_fn.items()))
    if total.stale_equivalents:
        print(f"\n{len(total.stale_equivalents)} listed in {args.equivalents.name} but not surviving "
              "(remove or re-check the row):")
        print("\n".join("  " + n for n in total.stale_equivalents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
