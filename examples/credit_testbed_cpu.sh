#!/usr/bin/env bash
# credit_testbed_cpu: the credit-assignment study on CPU (examples/credit_testbed_cpu.yaml for every cell):
# every method x 5 seeds on chain6 with a 300 s budget per cell, as many cells at once as cores allow.
# Arguments are passed to tools/credit_testbed.py (e.g. --seeds 3 --budget-s 120 --task chain6,chain6late).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS=${JOBS:-$(( $(nproc) > 1 ? $(nproc) : 1 ))}
exec python "${ROOT}/tools/credit_testbed.py" --config "${ROOT}/examples/credit_testbed_cpu.yaml" \
    --methods grpo,dapo,fipo,ppo,comppo --seeds 5 --task chain6 --budget-s 300 --jobs "${JOBS}" \
    --out "${ROOT}/runs/testbed" "$@"
