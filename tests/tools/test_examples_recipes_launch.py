"""The recipes in ``examples/`` and the launchers: every recipe loads and fits its declared cluster (the
planner), the published settings are what the recipes say, the CPU recipe trains through
``examples/launch/torchrun.sh`` as two nodes on localhost (and its checkpoint exports to HF with the
trained weights), and ``slurm.sbatch`` under a fake Slurm prints each node's torchrun command."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from megatron_credit.recipe.config import load_recipe

from tests.support.paths import ROOT
from tests.support.runs import metrics_rows

RECIPES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
NAMES = [os.path.splitext(os.path.basename(r))[0] for r in RECIPES]


def test_the_issue_s_recipes_exist_with_launch_scripts():
    expected = {"fipo_qwen25_32b", "fipo_qwen25_math_7b", "dapo_qwen25_32b", "comppo_qwen3_4b", "grpo_qwen3_4b",
                "ppo_qwen25_7b", "grpo_qwen25_7b", "demo_cpu"}
    assert expected <= set(NAMES)
    for name in NAMES:
        script = os.path.join(ROOT, "examples", f"{name}.sh")
        assert os.access(script, os.X_OK), script


@pytest.mark.parametrize("path", RECIPES, ids=NAMES)
def test_every_recipe_fits_its_declared_cluster(path):
    from megatron_credit.planning.plan import format_plan, plan, resolve_hf_config

    from megatron_credit.planning.pool import plan_pool, trainer_gpus

    recipe = load_recipe(path)
    c = recipe.cluster
    nodes, gpn = c.nodes, c.gpus_per_node
    if recipe.rollout.ranks:  # a rollout pool: its engines fit too, and the trainer is planned on the rest
        pool = plan_pool(recipe, resolve_hf_config(recipe.model), nodes=nodes, gpus_per_node=gpn, gpu=c.gpu)
        assert pool.fits, "\n".join(pool.lines())
        nodes, gpn = trainer_gpus(recipe, nodes=nodes, gpus_per_node=gpn)
    result = plan(recipe, resolve_hf_config(recipe.model), nodes=nodes, gpus_per_node=gpn, gpu=c.gpu)
    assert result.fits, format_plan(result)
    # The header comment states the same layout and cluster as the fields.
    with open(path, encoding="utf-8") as f:
        header = f.read().split("\nmodel:")[0]
    if c.gpus_per_node == 8:
        lay = result.layout
        assert f"{c.nodes} node" in header and "8 H100-80GB" in header, header
        assert (f"TP={lay['tp']}" in header and f"PP={lay['pp']}" in header and f"CP={lay['cp']}" in header
                and f"DP={lay['dp']}" in header), header


def _params(name):
    recipe = load_recipe(os.path.join(ROOT, "examples", f"{name}.yaml"))
    return recipe, recipe.algorithm.config()


def test_published_settings():
    fipo, fp = _params("fipo_qwen25_32b")
    r, o, t, a = fipo.rollout, fipo.optim, fipo.train, fipo.algorithm
    assert (r.prompts_per_step, r.n, r.temperature, r.top_p, r.max_response_len) == (512, 16, 1.0, 1.0, 20480)
    assert r.prompts_per_step // t.num_minibatches == 64 and t.epochs == 1
    assert (o.lr, o.schedule, o.warmup_steps, o.weight_decay, o.clip_grad) == (1e-6, "constant", 10, 0.1, 1.0)
    assert fipo.data.max_prompt_len == 2048 and fipo.reward.overlong_buffer_len == 4096
    assert fipo.reward.overlong_penalty_factor == 1.0 and a.kl_coef == 0.0 and a.dynamic_sampling
    assert (fp.clip_low, fp.clip_high, fp.dual_clip_c, fp.tau, fp.weight_clip, fp.safety_thresh) == (
        0.2, 0.28, 10.0, 32.0, (1.0, 1.2), 10.0)
    assert fipo.model.params_dtype == "bfloat16" and fipo.model.name_or_path.endswith("Qwen2.5-32B")

    f7, f7p = _params("fipo_qwen25_math_7b")
    assert f7.rollout.n == 32 and f7p.weight_clip == (0.8, 1.2) and f7p.safety_thresh == 3.0
    assert f7.data.max_prompt_len + f7.rollout.max_response_len <= 4096  # the model's context
    assert f7.rollout.prompts_per_step // f7.train.num_minibatches == 64

    dapo, dp = _params("dapo_qwen25_32b")
    assert dapo.algorithm.name == "dapo" and dapo.rollout.prompts_per_step // dapo.train.num_minibatches == 32
    assert (dp.clip_low, dp.clip_high, dp.dual_clip_c) == (0.2, 0.28, 10.0)
    for section in ("rollout", "optim", "reward", "data", "parallel", "cluster"):
        assert getattr(dapo, section) == getattr(fipo, section), section

    comp, cp = _params("comppo_qwen3_4b")
    r, o, t = comp.rollout, comp.optim, comp.train
    assert (r.prompts_per_step, r.n, r.max_response_len, r.temperature, r.top_p) == (4, 4, 16384, 1.0, 0.7)
    assert r.prompts_per_step * r.n // t.num_minibatches == 4 and t.epochs == 2
    assert (o.lr, o.critic_lr, o.beta1, o.beta2, o.weight_decay, o.clip_grad) == (1e-6, 1e-5, 0.9, 0.999, 0.0, 1.0)
    assert comp.algorithm.kl_coef == 2e-3 and comp.model.params_dtype == "bfloat16"
    assert (cp.clip_eps, cp.lam, cp.k_lo, cp.k_hi, cp.gate_tau, cp.value_clamp) == (0.2, 0.95, 0.1, 0.9, 4.0, 1.0)
    assert type(comp.algorithm.build()).__name__ == "CompPO"

    grpo4, gp = _params("grpo_qwen3_4b")
    assert grpo4.algorithm.kl_coef == 1e-3 and gp.clip_eps == 0.2
    for section in ("rollout", "train", "data", "parallel", "cluster", "model"):
        assert getattr(grpo4, section) == getattr(comp, section), section


def _free_port() -> int:
    from tests.support.distributed_harness import _free_port as free

    return free()


TWO_NODE_OVERRIDES = ["train.steps=2", "warmup.steps=20", "warmup.batch_size=16", "rollout.prompts_per_step=8",
                      "train.val_every=2", "train.val_prompts=8", "train.val_samples=2", "checkpoint.every=0",
                      "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
                      "algorithm.name=ppo"]  # the value loss has a gradient even when every answer is wrong


@pytest.mark.dist
def test_two_nodes_on_localhost_train_and_export(tmp_path):
    """``torchrun.sh`` twice (NNODES=2, NODE_RANK 0 and 1, one process each, gloo): DP = 2 across the
    "nodes"; two iterations with validation; then the checkpoint exported to HF holds the trained weights."""
    run = tmp_path / "run"
    env = dict(os.environ, NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    args = [os.path.join(ROOT, "examples", "launch", "torchrun.sh"), "--config",
            os.path.join(ROOT, "examples", "demo_cpu.yaml"), "--output-dir", str(run),
            f"warmup.cache_dir={tmp_path / 'cache'}", *TWO_NODE_OVERRIDES]
    procs = [subprocess.Popen(args, env=dict(env, NODE_RANK=str(rank)), cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "layout TP=1 PP=1 CP=1 DP=2" in outs[0]
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["actor/grad_norm"] > 0
    last = rows[-1]
    assert 0.0 <= last["val/accuracy"] <= last["val/pass@2"] <= 1.0 and "val/cons@2" in last
    ckpt = run / "checkpoints" / "iter_0000002"
    assert json.loads((ckpt / "meta.json").read_text())["layout"]["dp"] == 2

    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_credit.commands.export_run_to_hf import main as export

    assert export(["--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    dcp_to_torch_save(str(ckpt / "model_optim"), str(tmp_path / "trained.pt"))
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)  # written by this test just above
    assert torch.equal(hf["model.embed_tokens.weight"], trained["embedding.word_embeddings.weight"])
    assert torch.equal(hf["lm_head.weight"], trained["output_layer.weight"])
    assert torch.equal(hf["model.layers.1.mlp.down_proj.weight"], trained["decoder.layers.mlp.linear_fc2.weight"][1])
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in hf.values())


FAKE_SRUN = """#!/usr/bin/env bash
# srun shim: run the command once per task with that task's SLURM_NODEID / SLURM_PROCID.
n=1
while [[ "$1" == --* ]]; do case "$1" in --ntasks=*) n=${1#--ntasks=};; esac; shift; done
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol shim: `scontrol show hostnames LIST` for the fake allocation node[01-04], a line at a time as a
# long real list comes: a reader that stops after the first line (`| head -n 1`) makes it die of SIGPIPE.
[[ "$1 $2" == "show hostnames" && "$3" == "node[01-04]" ]] || { echo "unexpected: $*" >&2; exit 1; }
for host in node01 node02 node03 node04; do echo "$host"; sleep 0.05; done
"""


@pytest.mark.spawn
def test_sbatch_under_a_fake_slurm_prints_the_torchrun_commands(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="node[01-04]", SLURM_NNODES="4",
               SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=ROOT, DRY_RUN="1", PYTHON="python")
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "launch", "slurm.sbatch"), "--config",
                           "examples/fipo_qwen25_32b.yaml", "--output-dir", "runs/fipo"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "slurm job 4242: 4 node(s) x 8 GPU(s), rendezvous node01:29500"
    launcher = os.path.join(ROOT, "pretrain_rl.py")
    assert lines[1:] == [
        f"node {i}: python -m torch.distributed.run --nnodes 4 --node-rank {i} --nproc-per-node 8 "
        f"--master-addr node01 --master-port 29500 {launcher} --config examples/fipo_qwen25_32b.yaml "
        "--output-dir runs/fipo" for i in range(4)]
    # Outside an allocation the script refuses to start.
    env.pop("SLURM_JOB_NODELIST")
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "launch", "slurm.sbatch")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not inside a Slurm allocation" in proc.stderr


@pytest.mark.dist
def test_torchrun_sh_refuses_a_node_rank_outside_nnodes():
    env = dict(os.environ, NNODES="2", NODE_RANK="2", DRY_RUN="1")
    proc = subprocess.run([os.path.join(ROOT, "examples", "launch", "torchrun.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "NODE_RANK=2 must be in [0, NNODES=2)" in proc.stderr


@pytest.mark.dist
def test_dry_run_prints_the_memory_plan():
    """``pretrain_rl.py --dry-run`` under the world size of a 32-GPU launch: the layout, the planner's table,
    exit 0; a world that fits the layout but not the memory exits 1."""
    def dry(world: int, *extra: str):
        env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--config",
                               os.path.join(ROOT, "examples", "fipo_qwen25_32b.yaml"), "--dry-run", "--skip-preflight", *extra],
                              env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)

    proc = dry(32)
    assert proc.returncode == 0, proc.stderr
    assert "layout TP=8 PP=2 CP=2 DP=1" in proc.stdout and "plan of 32 rank(s): fipo, 4 node(s) x 8 h100-80gb" in proc.stdout
    assert "verdict: FITS" in proc.stdout and "activations" in proc.stdout
    proc = dry(8, "parallel.pipeline_model_parallel_size=1", "parallel.context_parallel_size=1",
               "train.recompute=selective")
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.spawn
def test_a_recipe_script_plans_then_prints_its_commands(tmp_path):
    """``examples/grpo_qwen25_7b.sh`` with the model folder's config.json (no weights: the preflight is skipped
    through PLAN_ARGS) and DRY_RUN=1: the plan passes on the declared node, then the torchrun command with the
    folder / data overrides, and no export of a run that has not reached train.steps."""
    from megatron_credit.planning.plan import KNOWN_ARCHITECTURES

    model_dir = tmp_path / "Qwen2.5-7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(dict(KNOWN_ARCHITECTURES["Qwen/Qwen2.5-7B"])))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK"))}
    env.update(MODEL_DIR=str(model_dir), DATA_DIR="/data/x", RUN_DIR="runs/g7", DRY_RUN="1", GPUS_PER_NODE="8",
               PYTHON=sys.executable, PYTHONPATH=ROOT, PLAN_ARGS="--skip-preflight")
    proc = subprocess.run([os.path.join(ROOT, "examples", "grpo_qwen25_7b.sh"), "train.steps=3"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "grpo, 1 node(s) x 8 h100-80gb" in out and "verdict: FITS" in out
    assert (f"node 0: {sys.executable} -m torch.distributed.run --nnodes 1 --node-rank 0 --nproc-per-node 8" in out
            and f"model.name_or_path={model_dir} data.train_path=/data/x/dapo-math-17k.parquet "
                "data.val_path=/data/x/aime-2024.parquet train.steps=3" in out), out
    assert "not exporting: runs/g7 is at iteration 0 of 3 (pre-empted?); resubmit to continue" in out
