#!/usr/bin/env bash
# fipo_qwen25_32b_async: examples/fipo_qwen25_32b_async.yaml, sized for 5 node(s) x 8 H100-80GB (the last node the rollout pool). Run on every node:
#   NNODES=5 NODE_RANK=<0..4> MASTER_ADDR=<node 0> examples/fipo_qwen25_32b_async.sh [key.sub=value ...]
# or under Slurm, the whole pipeline with one task per node (NODE_RANK from SLURM_NODEID, MASTER_ADDR from
# SLURM_JOB_NODELIST): srun --nodes 5 --ntasks-per-node 1 examples/fipo_qwen25_32b_async.sh
# See examples/launch/run_recipe.sh for MODEL_DIR, DATA_DIR, RUN_DIR, EXPORT_DIR.
set -euo pipefail
export RECIPE=examples/fipo_qwen25_32b_async.yaml MODEL_ID=Qwen/Qwen2.5-32B
export NNODES=${NNODES:-${SLURM_NNODES:-5}} NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
exec "$(dirname "${BASH_SOURCE[0]}")/launch/run_recipe.sh" "$@"
