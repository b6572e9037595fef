#!/usr/bin/env bash
# dapo_qwen25_32b: examples/dapo_qwen25_32b.yaml, sized for 4 node(s) x 8 H100-80GB. Run on every node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> examples/dapo_qwen25_32b.sh [key.sub=value ...]
# or under Slurm, the whole pipeline with one task per node (NODE_RANK from SLURM_NODEID, MASTER_ADDR from
# SLURM_JOB_NODELIST), in a job asked for the warning lead tools/plan.py prints for the recipe
# (sbatch/salloc --signal=USR1@<lead>):
#   srun --nodes 4 --ntasks-per-node 1 examples/dapo_qwen25_32b.sh
# See examples/launch/run_recipe.sh for MODEL_DIR, DATA_DIR, RUN_DIR, EXPORT_DIR, PLAN_ARGS and DRY_RUN=1.
set -euo pipefail
trap '' USR1   # the trainer's pre-emption signal, ignored by its launchers (see launch/run_recipe.sh)
export RECIPE=examples/dapo_qwen25_32b.yaml MODEL_ID=Qwen/Qwen2.5-32B
export NNODES=${NNODES:-${SLURM_NNODES:-4}} NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
exec "$(dirname "${BASH_SOURCE[0]}")/launch/run_recipe.sh" "$@"
