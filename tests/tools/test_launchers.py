"""Every launcher in ``examples/`` under DRY_RUN=1, and the decisions they take for real, with nothing real run.

The recipe scripts (each ``examples/*.sh`` that goes through ``launch/run_recipe.sh``, found by a glob, so a
new recipe is covered with no new test), ``launch/torchrun.sh`` and the CPU scripts that call it,
``launch/slurm.sbatch`` under a fake Slurm, and ``launch/submit.sh``. Fake ``hf``, ``huggingface-cli``,
``srun``, ``scontrol`` and ``sbatch`` executables on PATH record their arguments; where a launcher runs for
real (not DRY_RUN), ``PYTHON`` is a shim that records the planner, the torchrun launch and the export and
runs anything else (the launcher's own checkpoint helper) in this interpreter. What is checked: the torchrun
command line, the download command and its fallback, the export decision taken from the run folder (a
pre-empted run, which the trainer also ends with exit 0, is not exported), that no launcher shell dies of
Slurm's SIGUSR1, and the ``--signal=USR1@<lead>`` submit.sh takes from the plan.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_credit.recipe.config import load_recipe
from tests.support.paths import ROOT

pytestmark = pytest.mark.spawn

EXAMPLES = os.path.join(ROOT, "examples")
LAUNCH = os.path.join(EXAMPLES, "launch")


def _scripts_calling(target: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(EXAMPLES, "*.sh")) if target in Path(p).read_text())


RECIPE_SCRIPTS = _scripts_calling("launch/run_recipe.sh")
CPU_SCRIPTS = _scripts_calling("launch/torchrun.sh")
IDS = [os.path.basename(p)[:-3] for p in RECIPE_SCRIPTS]


def _script_vars(path: str) -> dict[str, str]:
    """RECIPE, MODEL_ID and the default NNODES a recipe script sets."""
    text = Path(path).read_text()
    out = dict(re.findall(r"\b(RECIPE|MODEL_ID)=(\S+)", text))
    out["NNODES"] = re.search(r"NNODES=\$\{NNODES:-\$\{SLURM_NNODES:-(\d+)\}\}", text).group(1)
    return out


FAKE_TOOL = r"""#!/usr/bin/env bash
# A stand-in for {name}: records its arguments (one call a line, tab-separated) in FAKE_LOG.
(IFS=$'\t'; echo "{name}"$'\t'"$*") >> "${{FAKE_LOG}}"
"""
FAKE_DOWNLOADER = r"""# ... and "downloads": a config.json in --local-dir.
while (( $# )); do [[ "$1" == --local-dir ]] && dir=$2; shift; done
mkdir -p "${dir}" && echo '{}' > "${dir}/config.json"
"""
FAKE_SBATCH = r"""echo "sbatch-env"$'\t'"REPO=${REPO:-}" >> "${FAKE_LOG}"
echo "Submitted batch job 4242"
"""
FAKE_SRUN = r"""# Slurm signals the processes of the step, not the batch shell, but `scancel --full` reaches it too: a
# USR1 to the batch shell (this one's parent) must not end the job. Then each task, with its SLURM_NODEID.
kill -USR1 "${PPID}"
n=1
while [[ "$1" == --* ]]; do case "$1" in --ntasks=*) n=${1#--ntasks=};; esac; shift; done
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit $?; done
"""
FAKE_SCONTROL = r"""[[ "$1 $2" == "show hostnames" ]] || exit 1
for host in node01 node02 node03 node04; do echo "$host"; sleep 0.02; done
"""
PYTHON_SHIM = r"""#!/usr/bin/env bash
# Stands in for `python` where a launcher runs the planner, torchrun or the export: records the call in
# FAKE_LOG; the plan prints FAKE_PLAN_OUT and exits FAKE_PLAN_RC; with FAKE_USR1=1 the "trainer" sends
# SIGUSR1 to its whole process group (what Slurm's --signal does to a job step), then exits 0 as the trainer
# does after its pre-emption checkpoint. Anything else runs in the real interpreter.
tool=""
case "${1:-}" in
  */tools/plan.py) tool=plan ;;
  */tools/export_run_to_hf.py) tool=export ;;
  -m) [[ "${2:-}" == torch.distributed.run ]] && tool=torchrun ;;
esac
[[ -n "${tool}" ]] || exec "%s" "$@"
(IFS=$'\t'; echo "${tool}"$'\t'"$*") >> "${FAKE_LOG}"
if [[ "${tool}" == plan ]]; then
  [[ -z "${FAKE_PLAN_OUT:-}" ]] || printf '%%s\n' "${FAKE_PLAN_OUT}"
  exit "${FAKE_PLAN_RC:-0}"
fi
if [[ "${tool}" == torchrun && "${FAKE_USR1:-0}" == 1 ]]; then kill -USR1 0; sleep 0.2; fi
exit 0
""" % sys.executable
PLAN_OUT = ("verdict: FITS (peak 1.0 of 79.6 GiB)\n"
            "Slurm warning lead (iteration + save, x1.25): sbatch --signal=USR1@4321 (a line that may grow)\n"
            "preflight: ok")


class Bench:
    """A temporary folder with the fake tools, a run folder, a model folder and the launchers' environment."""

    def __init__(self, tmp_path: Path, tools=("hf", "huggingface-cli", "srun", "scontrol", "sbatch")):
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.touch()
        texts = {"hf": FAKE_DOWNLOADER, "huggingface-cli": FAKE_DOWNLOADER, "sbatch": FAKE_SBATCH,
                 "srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL}
        for name in tools:
            self._exe(name, FAKE_TOOL.format(name=name) + texts[name])
        self.shim = self._exe("python-shim", PYTHON_SHIM)
        self.run_dir = tmp_path / "run"
        self.data = tmp_path / "data"
        # PATH: the fakes, then the system's folders without a real downloader or Slurm command in them.
        faked = ("hf", "huggingface-cli", "srun", "scontrol", "sbatch")
        keep = [d for d in os.environ["PATH"].split(os.pathsep)
                if d and not any(os.path.exists(os.path.join(d, n)) for n in faked)]
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "DRY_RUN",
                                         "MODEL_", "RUN_DIR", "DATA_DIR", "EXPORT_DIR", "ADAPTER_DIR", "PLAN_ARGS",
                                         "REPO"))}
        self.env.update(PATH=os.pathsep.join([str(self.bin), *keep]), FAKE_LOG=str(self.log),
                        PYTHON=sys.executable, DATA_DIR=str(self.data), RUN_DIR=str(self.run_dir),
                        MASTER_ADDR="node01", OMP_NUM_THREADS="1")

    def _exe(self, name: str, text: str) -> Path:
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def model_dir(self, model_id: str, present: bool) -> Path:
        path = self.tmp / "models" / model_id.split("/")[-1]
        if present:
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
        return path

    def checkpoint(self, step: int, complete: bool = True) -> None:
        """The files ``run_dir.complete_checkpoints`` reads: ``checkpoints/iter_NNNNNNN/`` with
        ``meta.json`` written last (a folder without it is a save cut short)."""
        path = self.run_dir / "checkpoints" / f"iter_{step:07d}"
        path.mkdir(parents=True)
        if complete:
            (path / "meta.json").write_text(json.dumps({"step": step}))

    def run(self, args, cwd=None, **env) -> subprocess.CompletedProcess:
        self.log.write_text("")
        # A session of its own: the shim's `kill -USR1 0` reaches the launcher's processes, not pytest.
        return subprocess.run(args, env={**self.env, **env}, cwd=str(cwd or self.tmp), capture_output=True,
                              text=True, timeout=120, start_new_session=True)

    def calls(self, tool: str) -> list[list[str]]:
        """The argument lists of the calls of ``tool`` since the last :meth:`run`."""
        rows = [line.split("\t") for line in self.log.read_text().splitlines()]
        return [[a for a in row[1:] if a] for row in rows if row[0] == tool]


def _torchrun_line(*, python, nnodes, rank, nproc, recipe, run_dir, model_dir, data, extra=()):
    return " ".join([f"node {rank}: {python} -m torch.distributed.run --nnodes {nnodes} --node-rank {rank}",
                     f"--nproc-per-node {nproc} --master-addr node01 --master-port 29500",
                     f"{ROOT}/pretrain_rl.py --config {ROOT}/{recipe} --output-dir {run_dir}",
                     f"model.name_or_path={model_dir} data.train_path={data}/dapo-math-17k.parquet",
                     f"data.val_path={data}/aime-2024.parquet", *extra])


NO_BASE_SUFFIX_ON_THE_HUB = ("Qwen/Qwen2.5-",)
"""Hub families whose pre-trained repositories carry no ``-Base`` suffix (``Qwen/Qwen2.5-32B`` is the base
model, the post-trained one is ``-Instruct``): a header's "Qwen2.5-32B-Base" is the id ``Qwen/Qwen2.5-32B``.
Qwen3 publishes both ``Qwen3-30B-A3B`` (post-trained) and ``Qwen3-30B-A3B-Base``: there the name must match."""


DRY_RUN_SCRIPTS = [p for p in RECIPE_SCRIPTS if os.path.basename(p)[:-3] in
                   ("grpo_qwen25_7b", "fipo_qwen25_32b", "fipo_qwen25_32b_async", "fipo_qwen3_30b_a3b")]
"""The scripts run under DRY_RUN: one node, four nodes, a rollout pool, a mixture of experts. Every recipe
script is the same three lines around ``launch/run_recipe.sh`` and differs only in its variables, which
:func:`test_every_recipe_script_names_its_recipe_s_model_and_nodes` checks for each; each recipe's plan is
checked in ``test_examples_recipes_launch.py``."""


@pytest.mark.parametrize("script", RECIPE_SCRIPTS, ids=IDS)
def test_every_recipe_script_names_its_recipe_s_model_and_nodes(script):
    """The model the script downloads is the one its recipe names, in the folder name and in the header; its
    default node count is the recipe's."""
    v = _script_vars(script)
    recipe = load_recipe(os.path.join(ROOT, v["RECIPE"]))
    base = v["MODEL_ID"].split("/")[-1]
    assert os.path.basename(recipe.model.name_or_path) == base, (v["MODEL_ID"], recipe.model.name_or_path)
    header = Path(ROOT, v["RECIPE"]).read_text().split("\nmodel:")[0]
    named = re.search(r"\bon ([A-Za-z][\w.-]*\d[\w.-]*)", header).group(1)
    assert named == base or (named == base + "-Base" and v["MODEL_ID"].startswith(NO_BASE_SUFFIX_ON_THE_HUB)), (
        f"{script}: MODEL_ID={v['MODEL_ID']}, the recipe's header says {named}")
    assert int(v["NNODES"]) == recipe.cluster.nodes
    assert Path(script).read_text().rstrip().endswith('exec "$(dirname "${BASH_SOURCE[0]}")/launch/run_recipe.sh" "$@"')


@pytest.mark.parametrize("script", DRY_RUN_SCRIPTS, ids=[os.path.basename(p)[:-3] for p in DRY_RUN_SCRIPTS])
def test_a_recipe_script_under_dry_run_prints_what_it_would_run(tmp_path, script):
    """The model absent: the download command; the plan (its preflight skipped: nothing is downloaded); the
    torchrun command of node 0 with the folder / data overrides; and, the run folder empty, no export."""
    assert len(DRY_RUN_SCRIPTS) == 4  # its variables: test_every_recipe_script_names_its_recipe_s_model_and_nodes
    v = _script_vars(script)
    bench = Bench(tmp_path)
    model_dir = bench.model_dir(v["MODEL_ID"], present=False)
    proc = bench.run([script, "train.steps=5"], DRY_RUN="1", MODEL_DIR=str(model_dir), PLAN_ARGS="--skip-preflight")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"download: hf download {v['MODEL_ID']} --local-dir {model_dir}.partial "
                        f"&& mv -T {model_dir}.partial {model_dir}")
    assert "verdict: FITS" in proc.stdout and re.search(r"--signal=USR1@\d+", proc.stdout), proc.stdout
    assert _torchrun_line(python=sys.executable, nnodes=v["NNODES"], rank=0, nproc=8, recipe=v["RECIPE"],
                          run_dir=bench.run_dir, model_dir=model_dir, data=bench.data, extra=["train.steps=5"]) in lines
    assert lines[-1] == f"not exporting: {bench.run_dir} is at iteration 0 of 5 (pre-empted?); resubmit to continue"
    assert bench.calls("hf") == [] and not model_dir.exists()  # a dry run downloads nothing


def test_another_node_waits_for_the_download_and_never_exports(tmp_path):
    bench = Bench(tmp_path)
    script = RECIPE_SCRIPTS[0]
    v = _script_vars(script)
    model_dir = bench.model_dir(v["MODEL_ID"], present=False)
    bench.checkpoint(5)  # finished: still node 0's to export
    proc = bench.run([script, "train.steps=5"], DRY_RUN="1", NNODES="4", NODE_RANK="3", MODEL_DIR=str(model_dir),
                     GPUS_PER_NODE="2", PYTHON=str(bench.shim))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"download: node 3 waits for {model_dir}/config.json (node 0 downloads {v['MODEL_ID']})",
        _torchrun_line(python=bench.shim, nnodes=4, rank=3, nproc=2, recipe=v["RECIPE"], run_dir=bench.run_dir,
                       model_dir=model_dir, data=bench.data, extra=["train.steps=5"])], proc.stdout
    [plan] = bench.calls("plan")
    assert plan[plan.index("--nodes") + 1] == "4" and plan[plan.index("--gpus-per-node") + 1] == "2"


@pytest.mark.parametrize("last,exported", [(2, False), (3, True)], ids=["pre-empted", "finished"])
def test_the_run_is_exported_only_at_train_steps(tmp_path, last, exported):
    """For real (the trainer a shim): Slurm's SIGUSR1 reaches every process of the step and the "trainer" exits
    0 as after its pre-emption checkpoint. No launcher shell dies of the signal, and the export runs only when
    the newest complete checkpoint is at train.steps (a folder without meta.json is not complete)."""
    bench = Bench(tmp_path)
    script = os.path.join(EXAMPLES, "grpo_qwen25_7b.sh")
    v = _script_vars(script)
    model_dir = bench.model_dir(v["MODEL_ID"], present=True)
    bench.checkpoint(1)
    bench.checkpoint(last)
    bench.checkpoint(last + 1, complete=False)  # the save the signal's kill cut short
    proc = bench.run([script, "train.steps=3"], MODEL_DIR=str(model_dir), PYTHON=str(bench.shim), FAKE_USR1="1",
                     FAKE_PLAN_OUT=PLAN_OUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [plan] = bench.calls("plan")
    assert plan == [f"{ROOT}/tools/plan.py", "--config", f"{ROOT}/{v['RECIPE']}", "--nodes", "1", "--gpus-per-node",
                    "8", "--output-dir", str(bench.run_dir), f"model.name_or_path={model_dir}",
                    f"data.train_path={bench.data}/dapo-math-17k.parquet",
                    f"data.val_path={bench.data}/aime-2024.parquet", "train.steps=3"]
    assert len(bench.calls("torchrun")) == 1 and bench.calls("hf") == []
    if exported:
        assert bench.calls("export") == [[f"{ROOT}/tools/export_run_to_hf.py", "--run-dir", str(bench.run_dir),
                                          "--out", f"{bench.run_dir}/hf"]]
        # a LoRA run: the merged model, then its adapters as a PEFT adapter
        proc = bench.run([script, "train.steps=3", "model.lora.rank=8"], MODEL_DIR=str(model_dir),
                         PYTHON=str(bench.shim), FAKE_PLAN_OUT=PLAN_OUT, ADAPTER_DIR=str(tmp_path / "adapter"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        export = [f"{ROOT}/tools/export_run_to_hf.py", "--run-dir", str(bench.run_dir)]
        assert bench.calls("export") == [[*export, "--out", f"{bench.run_dir}/hf"],
                                         [*export, "--out", str(tmp_path / "adapter"), "--adapter"]]
    else:
        assert bench.calls("export") == []
        assert proc.stdout.splitlines()[-1] == (f"not exporting: {bench.run_dir} is at iteration 2 of 3 "
                                                "(pre-empted?); resubmit to continue")


@pytest.mark.parametrize("tools,used", [(("hf", "huggingface-cli"), "hf"), (("huggingface-cli",), "huggingface-cli")],
                         ids=["hf", "huggingface-cli-fallback"])
def test_the_download_uses_hf_or_falls_back_to_huggingface_cli(tmp_path, tools, used):
    bench = Bench(tmp_path, tools=tools)
    script = os.path.join(EXAMPLES, "grpo_qwen25_7b.sh")
    v = _script_vars(script)
    model_dir = bench.model_dir(v["MODEL_ID"], present=False)
    proc = bench.run([script], MODEL_DIR=str(model_dir), PYTHON=str(bench.shim), FAKE_PLAN_OUT=PLAN_OUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert bench.calls(used) == [["download", v["MODEL_ID"], "--local-dir", f"{model_dir}.partial"]]
    assert all(bench.calls(t) == [] for t in tools if t != used)
    # Renamed when complete: the other nodes wait for this config.json, never a half-written folder's.
    assert (model_dir / "config.json").is_file() and not Path(f"{model_dir}.partial").exists()
    # With the model there, a second launch downloads nothing.
    proc = bench.run([script], MODEL_DIR=str(model_dir), PYTHON=str(bench.shim), FAKE_PLAN_OUT=PLAN_OUT)
    assert proc.returncode == 0 and bench.calls(used) == []


@pytest.mark.parametrize("dry", ["0", "1"])
def test_without_a_downloader_one_error_line_and_exit_2(tmp_path, dry):
    bench = Bench(tmp_path, tools=())
    script = os.path.join(EXAMPLES, "grpo_qwen25_7b.sh")
    model_dir = bench.model_dir(_script_vars(script)["MODEL_ID"], present=False)
    proc = bench.run([script], DRY_RUN=dry, MODEL_DIR=str(model_dir), PYTHON=str(bench.shim))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and "hf" in line and "huggingface-cli" in line
    assert line.endswith("pip install -U huggingface_hub") and bench.calls("plan") == []


@pytest.mark.dist  # the command names torchrun.sh (tests/support/spawn_guard.py); nothing starts a gloo world
def test_torchrun_sh_prints_its_command_and_outlives_sigusr1(tmp_path):
    bench = Bench(tmp_path)
    launcher = os.path.join(LAUNCH, "torchrun.sh")
    args = [launcher, "--config", "examples/demo_cpu.yaml", "--output-dir", "runs/d", "train.steps=2"]
    proc = bench.run(args, DRY_RUN="1", NNODES="3", NODE_RANK="2", GPUS_PER_NODE="4", MASTER_PORT="29611")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"node 2: {sys.executable} -m torch.distributed.run --nnodes 3 --node-rank 2 "
                           f"--nproc-per-node 4 --master-addr node01 --master-port 29611 {ROOT}/pretrain_rl.py "
                           "--config examples/demo_cpu.yaml --output-dir runs/d train.steps=2\n")
    # For real, with the shim as torchrun: its process group gets SIGUSR1 (Slurm's warning), and the launch
    # exits 0 with the "trainer" (ignored from torchrun.sh's first line, the signal stays ignored through exec).
    proc = bench.run(args, PYTHON=str(bench.shim), FAKE_USR1="1")
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    [call] = bench.calls("torchrun")
    assert call[:2] == ["-m", "torch.distributed.run"] and call[-5:] == args[1:]


@pytest.mark.parametrize("script", CPU_SCRIPTS, ids=[os.path.basename(p)[:-3] for p in CPU_SCRIPTS])
def test_a_cpu_script_under_dry_run_prints_its_torchrun_command(tmp_path, script):
    bench = Bench(tmp_path)
    proc = bench.run([script, "train.steps=2"], DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    name = os.path.basename(script)[:-3]
    assert proc.stdout == (f"node 0: {sys.executable} -m torch.distributed.run --nnodes 1 --node-rank 0 "
                           f"--nproc-per-node 1 --master-addr node01 --master-port 29500 {ROOT}/pretrain_rl.py "
                           f"--config {EXAMPLES}/{name}.yaml train.steps=2\n")


def test_slurm_sbatch_under_a_fake_slurm(tmp_path):
    """Every node's torchrun command from the allocation's variables; the batch shell outlives a SIGUSR1 (the
    fake srun sends one to it); the header keeps a default lead, which submit.sh overrides per recipe."""
    text = Path(LAUNCH, "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=USR1@\d+$", text, re.M) and "submit.sh" in text
    bench = Bench(tmp_path)
    proc = bench.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), "--config", "examples/demo_cpu.yaml",
                      "--output-dir", "runs/d"], DRY_RUN="1", SLURM_JOB_NODELIST="node[01-04]", SLURM_NNODES="4",
                     SLURM_JOB_ID="77", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=ROOT, PYTHON="python",
                     MASTER_ADDR="")
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[0] == "slurm job 77: 4 node(s) x 8 GPU(s), rendezvous node01:29500"
    assert lines[1:] == [f"node {i}: python -m torch.distributed.run --nnodes 4 --node-rank {i} --nproc-per-node 8 "
                         f"--master-addr node01 --master-port 29500 {ROOT}/pretrain_rl.py --config "
                         "examples/demo_cpu.yaml --output-dir runs/d" for i in range(4)]
    assert bench.calls("scontrol") == [["show", "hostnames", "node[01-04]"]]
    [srun] = bench.calls("srun")
    assert srun[:3] == ["--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]


def test_submit_sh_dry_run_takes_the_lead_from_the_plan(tmp_path):
    """The real planner: the sbatch command asks for the lead the plan printed for this recipe and node count."""
    bench = Bench(tmp_path)
    args = ["--nodes", "1", "--config", "examples/grpo_qwen25_7b.yaml", "--output-dir", "runs/g7", "train.steps=3"]
    proc = bench.run([os.path.join(LAUNCH, "submit.sh"), *args], cwd=ROOT, DRY_RUN="1", PLAN_ARGS="--skip-preflight")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    planned = re.findall(r"sbatch --signal=USR1@(\d+)", proc.stdout)
    assert len(planned) == 2 and "verdict: FITS" in proc.stdout, proc.stdout  # the plan's line, then submit's
    assert proc.stdout.splitlines()[-1] == (
        f"submit: REPO={ROOT} sbatch --signal=USR1@{planned[0]} --nodes 1 {LAUNCH}/slurm.sbatch "
        "--config examples/grpo_qwen25_7b.yaml --output-dir runs/g7 train.steps=3")
    assert bench.calls("sbatch") == []


def test_submit_sh_submits_with_the_plan_s_lead(tmp_path):
    bench = Bench(tmp_path)
    args = ["--config", "examples/grpo_qwen25_7b.yaml", "--nodes", "2", "--resume", "none", "--output-dir=runs/x",
            "train.steps=3", "--plugin", "examples/plugins/token_weighted_grpo.py"]
    proc = bench.run([os.path.join(LAUNCH, "submit.sh"), *args], PYTHON=str(bench.shim), FAKE_PLAN_OUT=PLAN_OUT,
                     PLAN_ARGS="--disk-gbps 2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [plan] = bench.calls("plan")
    assert plan == [f"{ROOT}/tools/plan.py", "--config", "examples/grpo_qwen25_7b.yaml", "--nodes", "2",
                    "--gpus-per-node", "8", "--output-dir", "runs/x", "--disk-gbps", "2", "train.steps=3"]
    train_args = [a for a in args if a not in ("--nodes", "2")]
    assert bench.calls("sbatch") == [["--signal=USR1@4321", "--nodes", "2", f"{LAUNCH}/slurm.sbatch", *train_args]]
    assert bench.calls("sbatch-env") == [[f"REPO={ROOT}"]]
    assert "Submitted batch job 4242" in proc.stdout
    # GPUS_PER_NODE set: the plan and the job both get it.
    proc = bench.run([os.path.join(LAUNCH, "submit.sh"), "--nodes=1", "--config=r.yaml"], PYTHON=str(bench.shim),
                     FAKE_PLAN_OUT=PLAN_OUT, GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert bench.calls("plan")[0][3:7] == ["--nodes", "1", "--gpus-per-node", "4"]
    assert bench.calls("sbatch") == [["--signal=USR1@4321", "--nodes", "1", "--gpus-per-node", "4",
                                      f"{LAUNCH}/slurm.sbatch", "--config=r.yaml"]]


@pytest.mark.parametrize("plan_out,plan_rc,rc,says", [
    ("verdict: DOES NOT FIT\nsbatch --signal=USR1@99", 1, 1, "failed (exit 1); not submitting"),
    ("error: model.name_or_path=/m: no such folder", 2, 2, "failed (exit 2); not submitting"),
    ("verdict: FITS", 0, 2, "printed no 'sbatch --signal=USR1@<seconds>' line"),
    ("sbatch --signal=USR1@90180 (over Slurm's 65535 s: save more often)", 0, 2, "over Slurm's 65535 s"),
], ids=["does-not-fit", "preflight", "no-lead", "lead-over-slurm-s-maximum"])
def test_submit_sh_submits_nothing_when_the_plan_fails(tmp_path, plan_out, plan_rc, rc, says):
    bench = Bench(tmp_path)
    proc = bench.run([os.path.join(LAUNCH, "submit.sh"), "--nodes", "1", "--config", "r.yaml"],
                     PYTHON=str(bench.shim), FAKE_PLAN_OUT=plan_out, FAKE_PLAN_RC=str(plan_rc))
    assert proc.returncode == rc and says in proc.stderr, (proc.returncode, proc.stderr)
    assert bench.calls("sbatch") == []


@pytest.mark.parametrize("args", [["--config", "r.yaml"], ["--nodes", "1"], ["--nodes", "x", "--config", "r.yaml"],
                                  ["--nodes"]], ids=["no-nodes", "no-config", "bad-nodes", "no-value"])
def test_submit_sh_usage(tmp_path, args):
    bench = Bench(tmp_path)
    proc = bench.run([os.path.join(LAUNCH, "submit.sh"), *args], PYTHON=str(bench.shim))
    assert proc.returncode == 2 and proc.stderr.startswith("usage: ") and bench.calls("plan") == []
