#!/usr/bin/env bash
# tool_calc_cpu: the multi-turn demo (examples/tool_calc_cpu.yaml, docs/multi_turn.md), the tiny actor learning
# to call the calculator, through the multi-node launcher on one machine: NNODES=1 GPUS_PER_NODE=1 by default.
# Arguments are recipe overrides.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-1}
exec "${ROOT}/examples/launch/torchrun.sh" --config "${ROOT}/examples/tool_calc_cpu.yaml" "$@"
