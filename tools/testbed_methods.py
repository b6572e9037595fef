"""The testbed's method labels: ``algo:variant+variant`` -> recipe overrides, and a directory name for each.

Shared by the runner (``tools/credit_testbed.py``) and the report (``tools/testbed_report.py``), which
therefore do not import each other.
"""
from __future__ import annotations

import re

# Named variants: method "algo:v1+v2" applies each variant's overrides (paths under algorithm.params).
# comppo: the 2x2 factorial gate {dynamic, fixed} x critic {tac, standard}, the shuffle / position
# controls, and ppo_equiv: a constant gate equal to PPO's gamma (1.0) with PPO's critic settings, which
# should reproduce ppo's curve for a seed (the papers' sanity check).
VARIANTS: dict[str, dict[str, dict[str, str]]] = {
    "comppo": {
        "dynamic": {"gate_control": "dynamic"}, "fixed": {"gate_control": "fixed"},
        "shuffle": {"gate_control": "shuffle"}, "position": {"gate_control": "position"},
        "tac": {"critic": "tac"}, "standard": {"critic": "standard"},
        "ppo_equiv": {"gate_control": "fixed", "fixed_gate": "1.0", "critic": "trunk", "value_clip": "0.2",
                      "adv_clip": "null", "whiten_advantages": "true"},
    },
}
_TAU = re.compile(r"tau(\d+(?:\.\d+)?)$")  # fipo:tau4 -> algorithm.params.tau=4


def method_overrides(method: str) -> list[str]:
    """Recipe overrides of a method label.

    >>> method_overrides("fipo:tau4"), method_overrides("comppo:fixed+standard")
    (['algorithm.name=fipo', 'algorithm.params.tau=4'], ['algorithm.name=comppo', \
'algorithm.params.gate_control=fixed', 'algorithm.params.critic=standard'])
    """
    name, _, rest = method.partition(":")
    out = [f"algorithm.name={name}"]
    for v in filter(None, rest.split("+")):
        if "=" in v:
            key, _, value = v.partition("=")
            out.append(f"algorithm.params.{key}={value}")
        elif _TAU.match(v):
            out.append(f"algorithm.params.tau={_TAU.match(v).group(1)}")
        elif v in VARIANTS.get(name, {}):
            out += [f"algorithm.params.{k}={x}" for k, x in VARIANTS[name][v].items()]
        else:
            known = sorted(VARIANTS.get(name, {})) + ["tauN", "key=value"]
            raise ValueError(f"--methods: unknown variant {v!r} of {name!r}; valid: {known}")
    return out


def slug(method: str) -> str:
    """A directory name for a method label."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", method.replace(":", "__").replace("+", "-"))
