#!/usr/bin/env bash
# fipo_qwen25_32b_async: examples/fipo_qwen25_32b_async.yaml, sized for 8 node(s) x 8 H100-80GB (the last 4 nodes
# the rollout pool). Run on every node:
#   NNODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> examples/fipo_qwen25_32b_async.sh [key.sub=value ...]
# or under Slurm, the whole pipeline with one task per node (NODE_RANK from SLURM_NODEID, MASTER_ADDR from
# SLURM_JOB_NODELIST), in a job asked for the warning lead tools/plan.py prints for the recipe
# (sbatch/salloc --signal=USR1@<lead>):
#   srun --nodes 8 --ntasks-per-node 1 examples/fipo_qwen25_32b_async.sh
# See examples/launch/run_recipe.sh for MODEL_DIR, DATA_DIR, RUN_DIR, EXPORT_DIR, PLAN_ARGS and DRY_RUN=1.
set -euo pipefail
trap '' USR1   # the trainer's pre-emption signal, ignored by its launchers (see launch/run_recipe.sh)
export RECIPE=examples/fipo_qwen25_32b_async.yaml MODEL_ID=Qwen/Qwen2.5-32B
export NNODES=${NNODES:-${SLURM_NNODES:-8}} NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
exec "$(dirname "${BASH_SOURCE[0]}")/launch/run_recipe.sh" "$@"
