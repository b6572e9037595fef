#!/usr/bin/env bash
# comppo_qwen3_4b: examples/comppo_qwen3_4b.yaml, sized for 1 node(s) x 8 H100-80GB. Run on every node:
#   NNODES=1 NODE_RANK=<0..0> MASTER_ADDR=<node 0> examples/comppo_qwen3_4b.sh [key.sub=value ...]
# or under Slurm, the whole pipeline with one task per node (NODE_RANK from SLURM_NODEID, MASTER_ADDR from
# SLURM_JOB_NODELIST): srun --nodes 1 --ntasks-per-node 1 examples/comppo_qwen3_4b.sh
# See examples/launch/run_recipe.sh for MODEL_DIR, DATA_DIR, RUN_DIR, EXPORT_DIR.
set -euo pipefail
export RECIPE=examples/comppo_qwen3_4b.yaml MODEL_ID=Qwen/Qwen3-4B
export NNODES=${NNODES:-${SLURM_NNODES:-1}} NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
exec "$(dirname "${BASH_SOURCE[0]}")/launch/run_recipe.sh" "$@"
