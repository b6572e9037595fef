"""The GPU check's wheelhouse: what ``tools/gpu_check.sh`` installs, offline, on the GPU machine.

    python tools/gpu_wheelhouse.py check-recipe      # tools/gpu_wheelhouse.txt against the machine and setup.py
    python tools/gpu_wheelhouse.py check-dir DIR     # the downloaded wheels: complete, cp312, < 60 MiB; a listing

The GPU machine has no network; ``tools/gpu_machine_packages.txt`` lists what it has, and
``tools/gpu_wheelhouse.txt`` pins what the check needs beyond that. The recipe holds when: it brings no
torch; it brings no package the machine has, unless it pins another version than the machine's; every
requirement of setup.py's ``install_requires`` (markers read as on CPython 3.12, Linux x86-64) names a
package of one list or the other, at a version the requirement admits where the lists pin one. A
downloaded folder holds when every pinned wheel is there once, each wheel installs on CPython 3.12
manylinux x86-64, each wheel's own requirements are on one list or the other, and the folder stays under
the limit (a call to the GPU machine carries at most 64 MiB). Exit 0 when all holds, 1 otherwise.
"""
from __future__ import annotations

import ast
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
MACHINE = REPO / "tools" / "gpu_machine_packages.txt"
WHEELHOUSE = REPO / "tools" / "gpu_wheelhouse.txt"
LIMIT_MIB = 60
# The GPU machine's interpreter and platform, for requirement markers.
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
WHEEL_TAGS = re.compile(r"^(py3-none-any|cp312-cp312-manylinux.*x86_64|py3-none-manylinux.*x86_64|"
                        r"cp312-abi3-manylinux.*x86_64|cp3\d-abi3-manylinux.*x86_64)$")


def read_list(path: Path) -> dict[str, Version | None]:
    """``name -> pinned version`` (None: any) from a list of ``name`` / ``name==version`` lines."""
    out: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if len(req.specifier) > len(pins) or len(pins) > 1:
            raise ValueError(f"{path.name}: {line!r} must be a name or name==version")
        name = canonicalize_name(req.name)
        if name in out:
            raise ValueError(f"{path.name}: {name} listed twice")
        out[name] = Version(pins[0]) if pins else None
    return out


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(MARKER_ENV)


def setup_requirements(setup_py: Path = REPO / "setup.py") -> list[Requirement]:
    """setup.py's ``install_requires`` that apply on the GPU machine (read from its source, not run)."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [r for r in map(Requirement, ast.literal_eval(node.value)) if _applies(r)]
    raise ValueError(f"{setup_py}: no install_requires")


def check_recipe(machine: dict, wheels: dict, requirements: list[Requirement]) -> list[str]:
    """What does not hold of the recipe ``wheels`` for the machine ``machine`` (see the module docstring)."""
    problems = []
    if "torch" in wheels:
        problems.append("the wheelhouse brings torch: the machine's own CUDA torch must be used")
    for name, version in wheels.items():
        if version is None:
            problems.append(f"{name}: the wheelhouse pins no version")
        if name in machine and (machine[name] is None or machine[name] == version):
            problems.append(f"{name}: the machine has it already ({machine[name] or 'any version'})")
    for req in filter(_applies, requirements):  # markers as on the GPU machine
        name = canonicalize_name(req.name)
        have = wheels.get(name) if name in wheels else machine.get(name, "missing")
        if have == "missing":
            problems.append(f"setup.py needs {req}: neither the machine nor the wheelhouse has it")
        elif have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(f"setup.py needs {req}: {name} {have} is there")
    return problems


def check_dir(folder: Path, machine: dict, wheels: dict, *, limit_mib: float = LIMIT_MIB) -> tuple[list[str], list[str]]:
    """``(problems, listing)`` of the downloaded wheels in ``folder`` (see the module docstring)."""
    problems, listing, found = [], [], {}
    files = sorted(folder.glob("*.whl"))
    for f in files:
        name, version, _, tags = parse_wheel_filename(f.name)
        found.setdefault(name, []).append(version)
        listing.append(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
        if not any(WHEEL_TAGS.match(str(t)) for t in tags):
            problems.append(f"{f.name}: does not install on CPython 3.12 manylinux x86-64")
        if name not in wheels:
            problems.append(f"{f.name}: not in tools/gpu_wheelhouse.txt")
        elif wheels[name] is not None and version != wheels[name]:
            problems.append(f"{f.name}: tools/gpu_wheelhouse.txt pins {wheels[name]}")
        with zipfile.ZipFile(f) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode("utf-8", "replace").splitlines()
        for line in lines:
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                dep = canonicalize_name(req.name)
                if _applies(req) and dep not in machine and dep not in wheels:
                    problems.append(f"{f.name} requires {req}: neither the machine nor the wheelhouse has it")
    for name in wheels:
        if len(found.get(name, [])) != 1:
            problems.append(f"{name}: {len(found.get(name, []))} wheels in {folder}, want 1")
    total = sum(f.stat().st_size for f in files) / 2**20
    listing.append(f"{total:8.2f} MiB  in all ({len(files)} wheels; the limit is {limit_mib:g} MiB)")
    if total > limit_mib:
        problems.append(f"the wheelhouse is {total:.1f} MiB, over the {limit_mib:g} MiB limit")
    return problems, listing


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    machine, wheels = read_list(MACHINE), read_list(WHEELHOUSE)
    if argv == ["check-recipe"]:
        problems = check_recipe(machine, wheels, setup_requirements())
    elif len(argv) == 2 and argv[0] == "check-dir":
        problems, listing = check_dir(Path(argv[1]), machine, wheels)
        print("\n".join(listing))
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
