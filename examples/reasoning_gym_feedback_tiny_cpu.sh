#!/usr/bin/env bash
# reasoning_gym_feedback_tiny_cpu: the feedback demo (examples/reasoning_gym_feedback_tiny_cpu.yaml,
# docs/multi_turn.md), the tiny actor answering a reasoning-gym task with retries, on one CPU process.
# Arguments are recipe overrides, e.g. algorithm.name=grpo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}
cd "${ROOT}"
exec "${PYTHON}" pretrain_rl.py --config examples/reasoning_gym_feedback_tiny_cpu.yaml "$@"
