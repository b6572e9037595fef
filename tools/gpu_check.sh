#!/usr/bin/env bash
# The one prepared GPU check: run it as soon as a GPU is lent (`make gpu-check`). About 10 minutes on one
# H200 (budget GPU_CHECK_BUDGET_S, default 600 s, checked before each part: a lent machine has 15 minutes
# including its start), it writes a markdown report:
#
#   setup          a venv with what the parts need, from the package registries
#   env            torch / CUDA / TE / vLLM / transformers / megatron-core versions, the GPU
#   trainer_*      the trainer itself first (tools/gpu_check_trainer.py): pretrain_rl.py on one GPU, bf16,
#                  the TE spec (the local spec where TE does not import, said so): the demo recipe for 3
#                  iterations with the HF engine (trainer_demo_hf) and with vLLM (trainer_demo_vllm), then
#                  a Llama-3.2-1B-shaped model (random init) at 4K-token responses for 2 iterations
#                  (trainer_llama1b, vLLM when the vLLM demo passed, else the HF engine); each prints
#                  tokens/s/GPU, mismatch/logprob_abs_mean from metrics.jsonl, and the peak memory against
#                  the planner's estimate. Their recipes are planned on CPU by tests/tools/test_gpu_check_recipes.py.
#   te_vs_local    the TE spec against the local spec on the invariance batch (logits, gradients; fp32, bf16),
#                  and the TP attributes of a TE model built without random init
#   vllm_roundtrip the vLLM engine's generate / weight sync / sleep / wake, engine vs trainer log-probs
#   pytest_gpu     `pytest -m gpu` (all GPU-marked tests but the vLLM file)
#   bench_kernels  Future-KL and log-prob + entropy kernels at T = 20K
#   bench_actor    actor forward-backward tokens/s at 4K and 16K for a ~1B (Llama-3.2-1B-shaped) model
#   pytest_vllm    tests/rollout/test_vllm_engine_gpu.py in the vLLM venv
#
# Every part degrades to "skipped: why" (no GPU, no TE, no vLLM, no registry, no time left) or
# "failed (...)" with its output tail; the script itself always exits 0 once the report is written.
#
# Usage: tools/gpu_check.sh [REPORT]   (default: $OUT/gpu_check_report.md when $OUT is set, else
#        runs/gpu_check_report.md). Environment: PYTHON (python3), GPU_CHECK_BUDGET_S (600),
#        GPU_CHECK_VENV (.cache/gpu_check/venv), GPU_CHECK_VLLM_VENV (.cache/gpu_check/venv-vllm); both
#        are reused by a later run on the same machine.
#
# Venvs: when the system python already has a CUDA torch (an NVIDIA container, maybe with TE), the main
# venv sees it (--system-site-packages) and vLLM 0.11.0, which pins torch==2.8.0, gets its own venv,
# installed in the background while the first parts run. On a bare machine one venv takes vLLM 0.11.0
# (and its torch 2.8.0) and the project; TE is then absent and the TE parts say so.
set -u
cd "$(dirname "$0")/.."
REPORT=${1:-${OUT:-runs}/gpu_check_report.md}
BUDGET=${GPU_CHECK_BUDGET_S:-600}
PY_SYS=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.cache/gpu_check/venv}
VVENV=${GPU_CHECK_VLLM_VENV:-.cache/gpu_check/venv-vllm}
mkdir -p "$(dirname "$REPORT")" "$(dirname "$VENV")" "$(dirname "$VVENV")"
LOGDIR=$(mktemp -d)
START=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
VLLM_PKGS=("vllm==0.33.0")  # issue 25: the engine targets vLLM 0.33 (it pins its own torch and transformers)

left() { echo $(( BUDGET - (SECONDS - START) )); }
report() { printf '%s\n' "$@" >> "$REPORT"; }

# run_part NAME CAP MIN command...: run with a time limit of min(CAP, time left); skip if < MIN s are left.
run_part() {
  local name=$1 cap=$2 min=$3; shift 3
  local remain t0=$SECONDS rc status limit
  remain=$(left)
  report "" "## $name"
  if [ -n "${SKIP_ALL:-}" ] && [ "$name" != env ]; then
    report "skipped: $SKIP_ALL"; echo "[$name] skipped: $SKIP_ALL"; return
  fi
  if (( remain < min )); then
    report "skipped: time budget ($remain s left, the part needs about $min s)"; echo "[$name] skipped (budget)"; return
  fi
  limit=$(( cap < remain ? cap : remain ))
  echo "[$name] running (limit ${limit}s, ${remain}s left)"
  timeout --kill-after=10 "$limit" "$@" > "$LOGDIR/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status="passed" ;;
    77) status="skipped: $(grep '^skipped: ' "$LOGDIR/$name.log" | tail -n 1 | sed 's/^skipped: //')" ;;
    5) status="skipped: no tests collected" ;;
    124|137) status="failed: timed out after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  report "$status ($(( SECONDS - t0 )) s)" '```'
  grep -v -E 'UserWarning|DeprecationWarning|FutureWarning|warnings\.warn' "$LOGDIR/$name.log" | tail -n 45 >> "$REPORT"
  report '```'
  echo "[$name] $status"
}

: > "$REPORT"
report "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo '?')" ""
if ! nvidia-smi -L > "$LOGDIR/smi.log" 2>&1; then
  report "no GPU: \`nvidia-smi -L\` failed: $(head -n 1 "$LOGDIR/smi.log")"
  SKIP_ALL="no GPU (nvidia-smi -L failed)"
else
  report '```' "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv)" '```'
fi

# --- venvs ------------------------------------------------------------------------------------------
VLLM_INSTALL_PID=
if [ -n "${SKIP_ALL:-}" ]; then
  MODE=none
elif "$PY_SYS" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  MODE=container
  [ -x "$VENV/bin/python" ] || "$PY_SYS" -m venv --system-site-packages "$VENV"
  SETUP=("$VENV/bin/python" -m pip install -q -e ".[test]")
  SETUP_CAP=150
  # vLLM pins torch==2.8.0: its own venv, so the container's torch (and TE built against it) stay intact.
  (
    if "$PY_SYS" -c "import vllm" 2>/dev/null; then
      [ -x "$VVENV/bin/python" ] || "$PY_SYS" -m venv --system-site-packages "$VVENV"
      "$VVENV/bin/python" -m pip install -q -e ".[test]"  # the trainer with vLLM (trainer_demo_vllm)
    else
      [ -x "$VVENV/bin/python" ] || "$PY_SYS" -m venv "$VVENV"
      "$VVENV/bin/python" -m pip install -q "${VLLM_PKGS[@]}" -e ".[test]"
    fi
  ) > "$LOGDIR/vllm_install.log" 2>&1 &
  VLLM_INSTALL_PID=$!
else
  MODE=bare
  VVENV=$VENV
  [ -x "$VENV/bin/python" ] || "$PY_SYS" -m venv "$VENV"
  SETUP=("$VENV/bin/python" -m pip install -q "${VLLM_PKGS[@]}" -e ".[test]")
  SETUP_CAP=300
fi
[ "$MODE" = none ] || report "" "venvs: $MODE ($VENV$( [ "$VVENV" != "$VENV" ] && echo ", vLLM in $VVENV"))"
if [ "$MODE" = none ]; then
  report "" "## setup" "skipped: $SKIP_ALL"
else
  run_part setup "$SETUP_CAP" 30 "${SETUP[@]}"
fi
PYM="$VENV/bin/python"
[ -x "$PYM" ] || PYM=$PY_SYS
run_part env 30 5 "$PYM" tools/gpu_check.py env
TRAIN_DIR=$LOGDIR/trainer
run_part trainer_demo_hf 100 40 "$PYM" tools/gpu_check_trainer.py run demo_hf "$TRAIN_DIR/demo_hf"

# --- vLLM: wait for its venv (bounded by the budget) ---------------------------------------------------
wait_vllm_install() {
  [ -z "${VLLM_INSTALL_PID:-}" ] && return 0
  while kill -0 "$VLLM_INSTALL_PID" 2>/dev/null; do
    if (( $(left) < 150 )); then kill "$VLLM_INSTALL_PID" 2>/dev/null; return 2; fi
    sleep 2
  done
  wait "$VLLM_INSTALL_PID"
}
if [ "$MODE" = none ]; then (exit 3); else wait_vllm_install; fi
case $? in
  0) VPY="$VVENV/bin/python" ;;
  2) VPY=; VLLM_WHY="the vLLM venv install did not finish within the time budget" ;;
  3) VPY=; VLLM_WHY=$SKIP_ALL ;;
  *) VPY=; VLLM_WHY="the vLLM venv install failed: $(tail -n 2 "$LOGDIR/vllm_install.log" 2>/dev/null | tr '\n' ' ')" ;;
esac
LLAMA=llama1b_hf LLAMA_PY=$PYM
if [ -n "$VPY" ]; then
  run_part trainer_demo_vllm 150 90 "$VPY" tools/gpu_check_trainer.py run demo_vllm "$TRAIN_DIR/demo_vllm"
  grep -q "^passed" <(grep -A1 '^## trainer_demo_vllm' "$REPORT" | tail -n 1) && LLAMA=llama1b_vllm LLAMA_PY=$VPY
else
  report "" "## trainer_demo_vllm" "skipped: $VLLM_WHY"
fi
run_part trainer_llama1b 240 120 "$LLAMA_PY" tools/gpu_check_trainer.py run "$LLAMA" "$TRAIN_DIR/llama1b"
rm -rf "$TRAIN_DIR"  # the random 1B checkpoint (2.5 GB)

# The later parts get what is left (each skips itself when its minimum is not).
run_part te_vs_local 60 30 "$PYM" tools/gpu_check.py te_vs_local
if [ -n "$VPY" ]; then
  run_part vllm_roundtrip 100 60 "$VPY" tools/gpu_check.py vllm_roundtrip
else
  report "" "## vllm_roundtrip" "skipped: $VLLM_WHY"
fi

run_part pytest_gpu 90 30 "$PYM" -m pytest -m gpu tests -q -p no:cacheprovider --timeout=80 \
  --ignore=tests/rollout/test_vllm_engine_gpu.py
run_part bench_kernels 45 20 "$PYM" tools/gpu_check.py bench_kernels
run_part bench_actor 60 40 "$PYM" tools/gpu_check.py bench_actor
if [ -n "$VPY" ]; then
  run_part pytest_vllm 100 60 "$VPY" -m pytest -m gpu tests/rollout/test_vllm_engine_gpu.py -q -p no:cacheprovider --timeout=90
else
  report "" "## pytest_vllm" "skipped: $VLLM_WHY"
fi

report "" "total: $(( SECONDS - START )) s of a ${BUDGET} s budget; logs in $LOGDIR"
echo "report written to $REPORT ($(( SECONDS - START )) s)"
exit 0
