#!/usr/bin/env bash
# reasoning_gym_feedback_tiny_cpu: the feedback demo (examples/reasoning_gym_feedback_tiny_cpu.yaml,
# docs/multi_turn.md), the tiny actor answering a reasoning-gym task with retries, on one CPU process.
# Arguments are recipe overrides, e.g. algorithm.name=grpo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}
# One torch thread: on 2 cores shared with another job, torch's two threads wait on each other (measured
# 15-19 s an iteration against 0.8 s with one thread; docs/multi_turn.md).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "${ROOT}"
exec "${PYTHON}" pretrain_rl.py --config examples/reasoning_gym_feedback_tiny_cpu.yaml "$@"
