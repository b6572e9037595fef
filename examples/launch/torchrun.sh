#!/usr/bin/env bash
# One node's share of a multi-node run: run this once on every node, with the same MASTER_ADDR /
# MASTER_PORT / NNODES and that node's NODE_RANK (0 .. NNODES-1). Arguments go to pretrain_rl.py:
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node01 examples/launch/torchrun.sh --config examples/fipo_qwen25_32b.yaml
#   NNODES=4 NODE_RANK=1 MASTER_ADDR=node01 examples/launch/torchrun.sh --config examples/fipo_qwen25_32b.yaml ...
#
# Environment (defaults): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# GPUS_PER_NODE (the visible GPUs, 1 without any), PYTHON (python). DRY_RUN=1 prints the command
# instead of running it. Node rank 0 hosts the rendezvous (torchrun's static TCP store on MASTER_ADDR).
set -euo pipefail
# SIGUSR1 is the trainer's (checkpoint.exit_signals): Slurm's --signal=USR1@<lead> reaches every process of
# the step, and this shell, then torchrun, which have no handler for it, would die of it and leave the
# workers headless. Ignored from the first line, it stays ignored through the exec into torchrun; the
# trainer ranks install their own handler for it.
trap '' USR1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${GPUS_PER_NODE}" -gt 0 ]] || GPUS_PER_NODE=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
if (( NODE_RANK < 0 || NODE_RANK >= NNODES )); then
  echo "error: NODE_RANK=${NODE_RANK} must be in [0, NNODES=${NNODES})" >&2
  exit 2
fi
cmd=("${PYTHON}" -m torch.distributed.run --nnodes "${NNODES}" --node-rank "${NODE_RANK}"
     --nproc-per-node "${GPUS_PER_NODE}" --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}"
     "${ROOT}/pretrain_rl.py" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "node ${NODE_RANK}: ${cmd[*]}"
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${cmd[@]}"
