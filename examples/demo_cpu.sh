#!/usr/bin/env bash
# demo_cpu: what `make demo` runs (examples/demo_cpu.yaml), here through the multi-node launcher on one
# machine: NNODES=1 GPUS_PER_NODE=1 by default. Arguments are recipe overrides.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-1}
exec "${ROOT}/examples/launch/torchrun.sh" --config "${ROOT}/examples/demo_cpu.yaml" "$@"
