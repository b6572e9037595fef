"""The process markers stay true: a test that starts processes is marked ``dist`` or ``spawn``, one
that runs the vLLM engine ``vllm``, so that ``make test-fast`` (``-m "not dist and not spawn and not vllm and
not slow and not gpu"``) runs only tests that start nothing.

Two checks: every test file is read here, and a file whose code starts processes must carry the marker (a
``pytestmark`` or a decorator; ``gloo_and_threads_pool`` marks its ``[gloo]`` runs itself); and at run time
``tests/support/spawn_guard.py`` fails any unmarked test that starts a gloo pool or a Python / shell / trainer
process, which the last tests here check on this (unmarked) test.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import spawn_guard
from tests.support.distributed_harness import DistributedPool

TESTS = Path(__file__).resolve().parents[1]
FILES = sorted(p for p in TESTS.rglob("test_*.py") if p != Path(__file__).resolve())  # this file starts both on purpose

DIST_CALLS = {"module_pool", "DistributedPool", "run_pretrain_rl", "train_tiny"}
"""Called in a test file, these start a gloo world in other processes: the file needs ``dist``."""
SPAWN_CALLS = {"VerifierWorkers"}
"""These start worker processes: the file needs ``spawn`` (or ``dist``)."""
DIST_STRINGS = ("pretrain_rl.py", "torch.distributed.run", "torchrun", "fakegpu_run")


def _uses(path: Path) -> set[str]:
    """What the code of ``path`` starts: a subset of {"dist", "spawn", "vllm"} (docstrings and comments aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    needs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name in DIST_CALLS:
                needs.add("dist")
            elif name in SPAWN_CALLS or owner == "subprocess" or name == "Popen":
                needs.add("spawn")
            if name == "importorskip" and any(isinstance(a, ast.Constant) and a.value == "vllm" for a in node.args):
                needs.add("vllm")
            if owner == "subprocess" and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                             and any(d in c.value for d in DIST_STRINGS)
                                             for a in node.args for c in ast.walk(a)):
                needs.add("dist")
        elif isinstance(node, ast.Import) and any(a.name == "vllm" for a in node.names):
            needs.add("vllm")
    return needs


def _marks(path: Path) -> set[str]:
    """The markers the file sets: ``pytest.mark.<name>`` anywhere in its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"}


def test_every_file_that_starts_processes_carries_the_marker():
    missing = []
    for path in FILES:
        needs, marks = _uses(path), _marks(path)
        if "dist" in needs and "dist" not in marks:
            missing.append(f"{path.relative_to(TESTS.parent)}: starts gloo workers or the trainer, no pytest.mark.dist")
        if "spawn" in needs and not marks & {"spawn", "dist"}:
            missing.append(f"{path.relative_to(TESTS.parent)}: starts processes, no pytest.mark.spawn")
        if "vllm" in needs and "vllm" not in marks:
            missing.append(f"{path.relative_to(TESTS.parent)}: runs vLLM, no pytest.mark.vllm")
    assert not missing, "\n".join(missing)


def test_the_scan_sees_what_starts_processes(tmp_path):
    src = tmp_path / "test_example.py"
    src.write_text('"""pretrain_rl.py in a docstring starts nothing."""\nimport subprocess\n\n'
                   "pool = module_pool(2)\n\n\ndef test_a():\n"
                   "    subprocess.run(['python', 'pretrain_rl.py'])\n    VerifierWorkers(None)\n"
                   "    pytest.importorskip('vllm')\n")
    assert _uses(src) == {"dist", "spawn", "vllm"}
    src.write_text('"""pretrain_rl.py, subprocess and DistributedPool in prose only."""\n'
                   "import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_b():\n    assert 1\n")
    assert _uses(src) == set() and _marks(src) == {"slow"}


@pytest.mark.parametrize("args,want", [
    ([sys.executable, "-c", "pass"], ("dist", "spawn")),
    (["python3", "tools/plan.py"], ("dist", "spawn")),
    (["bash", "tools/gpu_check.sh"], ("dist", "spawn")),
    ([Path("examples/grpo_qwen25_7b.sh"), "train.steps=3"], ("dist", "spawn")),
    ([sys.executable, Path("/repo/pretrain_rl.py"), "--dry-run"], ("dist",)),
    ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "x.py"], ("dist",)),
    (["/repo/examples/launch/torchrun.sh"], ("dist",)),
    ([sys.executable, "-m", "tests.support.fakegpu_run", "--config", "c.yaml"], ("dist",)),
    (f"{sys.executable} -c pass", ("dist", "spawn")),
    (["nvidia-smi", "-L"], ()),
    (["git", "status"], ()),
    ([], ()),
])
def test_which_commands_need_which_marker(args, want):
    assert spawn_guard.markers_for(args) == want


def test_an_unmarked_test_cannot_start_a_python_process():
    with pytest.raises(RuntimeError, match=r"test_an_unmarked_test_cannot_start_a_python_process starts a process "
                                           r"\(.* -c pass \.\.\.\) but is not marked dist or spawn: add "
                                           r"@pytest\.mark\.dist"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_an_unmarked_test_cannot_start_a_gloo_pool():
    pool = DistributedPool(world_size=2)
    with pytest.raises(RuntimeError, match=r"starts 2 gloo worker processes \(DistributedPool\) but is not marked "
                                           r"dist: add @pytest\.mark\.dist"):
        pool.start()
    assert pool._procs == []  # refused before any process was made
