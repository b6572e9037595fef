#!/usr/bin/env bash
# The one prepared GPU check (`make gpu-check`), for the machine we get: one H200, Python 3.12, torch with
# CUDA, transformers, triton, pytest and a few more (tools/gpu_machine_packages.txt), and no network. What
# it lacks travels with the working tree as wheels (`make gpu-wheelhouse`, .cache/gpu_wheelhouse/), which
# the setup step installs with --no-index into a folder on PYTHONPATH; the machine's own torch is used and
# the project runs from the working tree. Nothing here reaches the network.
#
# Parts, in order, each with its own time limit (seconds; results are printed as they come and appended to
# the report). The budget, 480 s (GPU_CHECK_BUDGET_S), bounds them all: a part gets the lesser of its limit
# and what is left, and is skipped with one line when less than it needs is left:
#
#   setup       10  the wheelhouse, installed offline
#   env         30  GPU, driver, torch, CUDA, megatron-core; whether TE and vLLM import
#   scenarios  100  the emulated-accelerator suite's scenarios on CUDA + NCCL (world size 1) against the
#                   same scenarios on this machine's CPU (tools/gpu_check_scenarios.py)
#   demo        85  examples/demo_cpu.yaml on the GPU, bf16, local spec, HF engine, 20 iterations: the
#                   reward rises, the rollout-vs-trainer mismatch stays under its bound
#   kernels     40  Future-KL, the scan, log-prob + entropy, concentration at T = 20,480
#   qwen15b    155  a Qwen2.5-1.5B-shaped model, one RL iteration at 4K-token responses: tokens/s, phases,
#                   peak memory against the planner
#   pytest_gpu  60  `pytest -m gpu` over the GPU-marked test files that need torch + megatron-core alone
#   profile     90  where the GPU waits (tools/gpu_check_profile.py): the demo's host syncs per micro-batch
#                   and its top kernels and idle share under torch.profiler; the HF engine's tokens/s and
#                   syncs per decode step on a Qwen2.5-1.5B shape at 1,024 new tokens. It gets what the parts
#                   before it leave (66 s after the 2026-12-04 run's 414 s) and stops its decode in time.
#
# Then, only where they import (else one line each, no time spent): te_vs_local (Transformer Engine),
# demo_vllm, vllm_roundtrip, pytest_vllm (vLLM), within what is left of the budget.
#
# Every part degrades to "skipped: why" or "failed (...)" with its output tail; the script exits 0 once the
# report is written. GPU_CHECK_DRY=1 walks every part on a machine without CUDA (CI: each part says why it
# skips; the wheelhouse step installs whatever GPU_CHECK_WHEELHOUSE holds).
#
# Usage: tools/gpu_check.sh [REPORT]   (default: $OUT/gpu_check_report.md when $OUT is set, else
#        runs/gpu_check_report.md). Environment: PYTHON (python3), GPU_CHECK_BUDGET_S (480),
#        GPU_CHECK_WHEELHOUSE (.cache/gpu_wheelhouse), GPU_CHECK_SITE (.cache/gpu_check/site: where the
#        wheels are unpacked), GPU_CHECK_DRY.
set -u
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then REPORT=${1:-$OUT/gpu_check_report.md}; else REPORT=${1:-runs/gpu_check_report.md}; fi
BUDGET=${GPU_CHECK_BUDGET_S:-480}
PY=${PYTHON:-python3}
WHEELHOUSE=${GPU_CHECK_WHEELHOUSE:-.cache/gpu_wheelhouse}
SITE=${GPU_CHECK_SITE:-.cache/gpu_check/site}
DRY=${GPU_CHECK_DRY:-}
mkdir -p "$(dirname "$REPORT")"
LOGDIR=$(mktemp -d)
START=$SECONDS
export PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
NO_VLLM="not installed (how to bring it: vLLM 0.33 pins its own torch build, ~1 GB of wheels, far over the 64 MiB a call carries: use a machine image that has vLLM; these parts then run here)"
NO_TE="not installed (how to bring it: Transformer Engine's PyTorch extension is built against the installed torch and has no wheel for torch 2.11 + CUDA 13 on PyPI: use an NGC PyTorch image, which ships it)"

left() { echo $(( BUDGET - (SECONDS - START) )); }
report() { printf '%s\n' "$@" >> "$REPORT"; }
say() { report "" "## $1" "$2"; echo "[$1] $2"; }

# run_part NAME CAP MIN command...: run with a time limit of min(CAP, time left); skip if < MIN s are left.
run_part() {
  local name=$1 cap=$2 min=$3; shift 3
  local remain t0=$SECONDS rc status limit
  remain=$(left)
  if [ -n "${SKIP_ALL:-}" ]; then say "$name" "skipped: $SKIP_ALL"; return; fi
  if (( remain < min )); then say "$name" "skipped: time budget ($remain s left, the part needs about $min s)"; return; fi
  limit=$(( cap < remain ? cap : remain ))
  echo "[$name] running (limit ${limit}s, ${remain}s left)"
  GPU_CHECK_PART_LIMIT_S=$limit timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log" | grep --line-buffered -E '^(- |  - |skipped: |failed: )'
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status="passed" ;;
    77) status="skipped: $(grep '^skipped: ' "$LOGDIR/$name.log" | tail -n 1 | sed 's/^skipped: //')" ;;
    5) status="skipped: no tests collected" ;;
    124|137) status="failed: timed out after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  report "" "## $name" "$status ($(( SECONDS - t0 )) s of ${cap} s)" '```'
  grep -v -E 'UserWarning|DeprecationWarning|FutureWarning|warnings\.warn' "$LOGDIR/$name.log" | tail -n 45 >> "$REPORT"
  report '```'
  echo "[$name] $status ($(( SECONDS - t0 )) s)"
}

: > "$REPORT"
report "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?')${DRY:+ (dry mode)}"
if ! nvidia-smi -L > "$LOGDIR/smi.log" 2>&1; then
  report "" "no GPU: \`nvidia-smi -L\` failed: $(head -n 1 "$LOGDIR/smi.log")"
  [ -n "$DRY" ] || SKIP_ALL="no GPU (nvidia-smi -L failed)"
fi

# --- setup: the wheelhouse, offline -----------------------------------------------------------------------
t0=$SECONDS
if [ -n "${SKIP_ALL:-}" ]; then
  say setup "skipped: $SKIP_ALL"
elif ! ls "$WHEELHOUSE"/*.whl > /dev/null 2>&1; then
  say setup "failed: no wheels in $WHEELHOUSE (run \`make gpu-wheelhouse\` where the registries are and carry .cache/gpu_wheelhouse with the tree): megatron-core will not import"
else
  rm -rf "$SITE" && mkdir -p "$SITE"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    timeout 60 "$PY" -m pip install --no-index --no-deps --no-compile --quiet --target "$SITE" "$WHEELHOUSE"/*.whl \
      > "$LOGDIR/setup.log" 2>&1
  else  # no pip: a wheel of pure modules (all of these) is a zip to unpack
    timeout 60 "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$SITE" "$WHEELHOUSE"/*.whl > "$LOGDIR/setup.log" 2>&1
  fi
  if [ $? -eq 0 ]; then
    say setup "passed ($(( SECONDS - t0 )) s): $(cd "$WHEELHOUSE" && ls *.whl | tr '\n' ' ')into $SITE"
  else
    say setup "failed: $(tail -n 3 "$LOGDIR/setup.log" | tr '\n' ' ')"
  fi
fi
export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the tree first, then the wheelhouse's

has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
run_part env 30 5 "$PY" tools/gpu_check.py env
run_part scenarios 100 40 "$PY" tools/gpu_check_scenarios.py all "$LOGDIR/scenarios"
run_part demo 85 40 "$PY" tools/gpu_check_trainer.py run demo_hf "$LOGDIR/demo"
run_part kernels 40 20 "$PY" tools/gpu_check.py bench_kernels
run_part qwen15b 155 100 "$PY" tools/gpu_check_trainer.py run qwen15b_hf "$LOGDIR/qwen15b"
rm -rf "$LOGDIR/qwen15b" "$LOGDIR/scenarios"  # random checkpoints
NO_CUDA=
[ -n "${SKIP_ALL:-}" ] || "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
  || NO_CUDA="CUDA is not available to torch"
if [ -n "$NO_CUDA" ]; then
  say pytest_gpu "skipped: $NO_CUDA"
else
  mapfile -t GPU_TESTS < <(grep -rlE 'pytest\.mark\.gpu' tests --include='test_*.py' | grep -v vllm | sort)
  run_part pytest_gpu 60 20 "$PY" -m pytest -m gpu "${GPU_TESTS[@]}" -q -p no:cacheprovider --timeout=50
fi
run_part profile 90 40 "$PY" tools/gpu_check_profile.py all "$LOGDIR/profile"
rm -rf "$LOGDIR/profile"

# --- only where Transformer Engine / vLLM import ------------------------------------------------------------
if [ -n "$NO_CUDA" ]; then
  for part in te_vs_local demo_vllm vllm_roundtrip pytest_vllm; do say "$part" "skipped: $NO_CUDA"; done
elif has transformer_engine; then
  run_part te_vs_local 60 30 "$PY" tools/gpu_check.py te_vs_local
else
  say te_vs_local "skipped: $NO_TE"
fi
if [ -n "$NO_CUDA" ]; then
  :
elif has vllm; then
  run_part demo_vllm 100 60 "$PY" tools/gpu_check_trainer.py run demo_vllm "$LOGDIR/demo_vllm"
  run_part vllm_roundtrip 100 60 "$PY" tools/gpu_check.py vllm_roundtrip
  run_part pytest_vllm 100 60 "$PY" -m pytest -m gpu tests/rollout/test_vllm_engine_gpu.py -q -p no:cacheprovider --timeout=90
else
  for part in demo_vllm vllm_roundtrip pytest_vllm; do say "$part" "skipped: $NO_VLLM"; done
fi

report "" "total: $(( SECONDS - START )) s of a ${BUDGET} s budget; logs in $LOGDIR"
echo "report written to $REPORT ($(( SECONDS - START )) s)"
exit 0
