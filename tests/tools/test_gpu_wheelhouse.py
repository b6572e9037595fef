"""The GPU check's wheelhouse (``tools/gpu_wheelhouse.py``), without the network: the committed recipe
(``tools/gpu_wheelhouse.txt``) against the machine's list and setup.py, and the checks of a downloaded
folder on wheels written here."""
from __future__ import annotations

import zipfile

from packaging.requirements import Requirement
from packaging.version import Version

from tools import gpu_wheelhouse as W


def _wheel(folder, name, version, tag="py3-none-any", requires=()):
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{name}/__init__.py", "")
    return path


def test_the_committed_recipe_fits_the_machine_and_setup_py():
    machine, wheels = W.read_list(W.MACHINE), W.read_list(W.WHEELHOUSE)
    assert W.check_recipe(machine, wheels, W.setup_requirements()) == []
    assert "torch" in machine and "torch" not in wheels
    assert wheels["megatron-core"] == Version("0.19.2")
    assert {"math-verify", "latex2sympy2-extended", "antlr4-python3-runtime"} <= set(wheels)


def test_the_recipe_check_names_each_problem():
    machine = {"torch": Version("2.11.0"), "numpy": None, "pyyaml": None}
    reqs = [Requirement("torch>=2.12"), Requirement("numpy"), Requirement("psutil>=5.9"),
            Requirement("triton; python_version < '3.12'")]  # the marker rules it out on 3.12
    problems = W.check_recipe(machine, {"torch": Version("2.12.0"), "numpy": Version("2.0"), "pyyaml": None},
                              reqs)
    text = "\n".join(problems)
    assert "brings torch" in text and "pyyaml: the wheelhouse pins no version" in text
    assert "pyyaml: the machine has it already" in text
    assert "numpy: the machine has it already" in text
    assert "psutil>=5.9: neither" in text and "triton" not in text
    assert W.check_recipe(machine, {}, [Requirement("torch>=2.12")]) == [
        "setup.py needs torch>=2.12: torch 2.11.0 is there"]
    # another version than the machine's: allowed (the project needs it)
    assert W.check_recipe({"numpy": Version("1.26")}, {"numpy": Version("2.0")}, [Requirement("numpy>=2")]) == []


def test_the_folder_check(tmp_path):
    machine = {"numpy": None}
    wheels = {"alpha": Version("1.0"), "beta": Version("2.0")}
    _wheel(tmp_path, "alpha", "1.0", requires=["numpy", "beta", "gamma; extra == 'dev'"])
    _wheel(tmp_path, "beta", "2.0", tag="cp312-cp312-manylinux_2_28_x86_64")
    problems, listing = W.check_dir(tmp_path, machine, wheels)
    assert problems == [] and listing[-1].endswith("in all (2 wheels; the limit is 60 MiB)")
    _wheel(tmp_path, "delta", "1.0", tag="cp311-cp311-manylinux_2_28_x86_64", requires=["epsilon"])
    (tmp_path / "beta-2.0-cp312-cp312-manylinux_2_28_x86_64.whl").unlink()
    problems, _ = W.check_dir(tmp_path, machine, wheels, limit_mib=1e-6)
    text = "\n".join(problems)
    assert "delta-1.0-cp311-cp311-manylinux_2_28_x86_64.whl: does not install on CPython 3.12" in text
    assert "delta-1.0-cp311-cp311-manylinux_2_28_x86_64.whl: not in tools/gpu_wheelhouse.txt" in text
    assert "requires epsilon: neither" in text and "beta: 0 wheels" in text and "over the 1e-06 MiB limit" in text
