#!/usr/bin/env bash
# moe_demo_cpu: examples/moe_demo_cpu.yaml (a tiny Qwen3-MoE-shaped actor on the demo's task) through the
# multi-node launcher on one machine: NNODES=1 GPUS_PER_NODE=1 by default. Arguments are recipe overrides
# (GPUS_PER_NODE=2 ... parallel.expert_model_parallel_size=2: the experts split over two ranks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-1}
exec "${ROOT}/examples/launch/torchrun.sh" --config "${ROOT}/examples/moe_demo_cpu.yaml" "$@"
