#!/usr/bin/env bash
# Download (if needed) -> plan -> train on NNODES nodes -> export the finished run to a Hugging Face folder.
# Called by the per-recipe scripts (examples/<recipe>.sh) on every node, with the torchrun.sh environment
# (NNODES, NODE_RANK, MASTER_ADDR, ...), or on every node of a Slurm allocation (one task per node:
# NODE_RANK from SLURM_NODEID, MASTER_ADDR from SLURM_JOB_NODELIST).
#
#   RECIPE      examples/<recipe>.yaml                       (set by the per-recipe script)
#   MODEL_ID    the Hugging Face id                          (set by the per-recipe script)
#   MODEL_DIR   local folder of the HF checkpoint            (default /models/<last part of MODEL_ID>)
#   DATA_DIR    folder with dapo-math-17k.parquet, aime-2024.parquet   (default /data)
#   RUN_DIR     output folder                                (default runs/<recipe>)
#   EXPORT_DIR  HF export of the trained policy              (default RUN_DIR/hf; a LoRA run's: merged)
#   ADAPTER_DIR a LoRA run's adapters as a PEFT adapter      (default RUN_DIR/hf_adapter; only with model.lora)
#   PLAN_ARGS   extra tools/plan.py options, split on spaces (e.g. "--disk-gbps 2", or "--skip-preflight"
#               to plan on a machine without the model, the data or the run folder's disk)
#   GPUS_PER_NODE  for the plan and torchrun                 (default SLURM_GPUS_ON_NODE, else 8)
#   PYTHON      the interpreter (default python)
#
# Node 0 downloads a missing model with `hf download` (huggingface_hub >= 1.0; `huggingface-cli download`
# where only that is installed) into MODEL_DIR.partial and renames it to MODEL_DIR when complete; the other
# nodes wait for MODEL_DIR/config.json (a shared file system is assumed). The trainer reads the HF
# safetensors directly and shards them on load (no conversion step). Extra arguments are recipe overrides
# (key.sub=value). After the trainer exits 0, node 0 exports the run's newest checkpoint with
# tools/export_run_to_hf.py only if that checkpoint is at the recipe's train.steps: the trainer also exits 0
# after a pre-emption signal (SIGTERM, SIGUSR1) has stopped it early, and that run is resubmitted, not
# exported. Under Slurm, ask for the warning signal with the lead `python tools/plan.py` prints
# (sbatch/salloc --signal=USR1@<lead>; examples/launch/submit.sh does it for slurm.sbatch).
#
# DRY_RUN=1: print the download command, run the plan, print the torchrun command and the export decision.
set -euo pipefail
# SIGUSR1 is the trainer's (checkpoint.exit_signals). Slurm's --signal=USR1@<lead> reaches every process
# of the step, this shell too, and bash dies of a signal it does not handle: the export step would be lost
# and the trainer's launcher gone. Ignored here, it stays ignored in every child (torchrun.sh, torchrun);
# the trainer ranks install their own handler.
trap '' USR1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${RECIPE:?set RECIPE}" "${MODEL_ID:?set MODEL_ID}"
name=$(basename "${RECIPE}" .yaml)
MODEL_DIR=${MODEL_DIR:-/models/${MODEL_ID##*/}}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/${name}}
EXPORT_DIR=${EXPORT_DIR:-${RUN_DIR}/hf}
ADAPTER_DIR=${ADAPTER_DIR:-${RUN_DIR}/hf_adapter}
PYTHON=${PYTHON:-python}
# Exported: the plan and torchrun.sh (which would count the visible GPUs, none on a login node) agree.
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
DRY_RUN=${DRY_RUN:-0}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
read -r -a plan_args <<<"${PLAN_ARGS:-}"   # used as ${plan_args[@]+...}: bash < 4.4 calls an empty array unset
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then   # under srun: the first host
  # The whole list is read, then its first line kept: `| head -n 1` can make scontrol die of SIGPIPE.
  hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST}")
  export MASTER_ADDR=${hosts%%$'\n'*}
fi

# The model. huggingface_hub >= 1.0 installs only `hf`, older releases only `huggingface-cli`; both take
# `download ID --local-dir DIR`. The download goes to MODEL_DIR.partial, renamed when complete, so that
# the other nodes, which wait for MODEL_DIR/config.json, never start on a half-written folder.
if [[ ! -f "${MODEL_DIR}/config.json" ]]; then
  if [[ "${NODE_RANK}" == 0 ]]; then   # a shared file system is assumed: one download
    if command -v hf >/dev/null 2>&1; then
      download=(hf download "${MODEL_ID}" --local-dir "${MODEL_DIR}.partial")
    elif command -v huggingface-cli >/dev/null 2>&1; then
      download=(huggingface-cli download "${MODEL_ID}" --local-dir "${MODEL_DIR}.partial")
    else
      echo "error: ${MODEL_DIR} has no config.json and neither hf nor huggingface-cli is on PATH to download" \
           "${MODEL_ID}: pip install -U huggingface_hub" >&2
      exit 2
    fi
    if [[ "${DRY_RUN}" == 1 ]]; then
      echo "download: ${download[*]} && mv -T ${MODEL_DIR}.partial ${MODEL_DIR}"
    else
      "${download[@]}"
      # -T: onto MODEL_DIR itself (an empty folder there is replaced; a non-empty one is an error).
      mv -T "${MODEL_DIR}.partial" "${MODEL_DIR}"
    fi
  elif [[ "${DRY_RUN}" == 1 ]]; then
    echo "download: node ${NODE_RANK} waits for ${MODEL_DIR}/config.json (node 0 downloads ${MODEL_ID})"
  else
    echo "node ${NODE_RANK}: waiting for node 0 to download ${MODEL_ID} to ${MODEL_DIR}"
    while [[ ! -f "${MODEL_DIR}/config.json" ]]; do sleep 10; done
  fi
fi

overrides=("model.name_or_path=${MODEL_DIR}" "data.train_path=${DATA_DIR}/dapo-math-17k.parquet"
           "data.val_path=${DATA_DIR}/aime-2024.parquet" "$@")
# The plan (exit 1: does not fit, 2: a missing model / data / disk) stops the launch before any GPU is used.
"${PYTHON}" "${ROOT}/tools/plan.py" --config "${ROOT}/${RECIPE}" --nodes "${NNODES:-1}" \
  --gpus-per-node "${GPUS_PER_NODE}" --output-dir "${RUN_DIR}" ${plan_args[@]+"${plan_args[@]}"} "${overrides[@]}"
"${ROOT}/examples/launch/torchrun.sh" --config "${ROOT}/${RECIPE}" --output-dir "${RUN_DIR}" "${overrides[@]}"
[[ "${NODE_RANK}" == 0 ]] || exit 0

# Prints "<newest complete checkpoint of RUN_DIR, 0 without one> <train.steps with the overrides>
# <model.lora.rank>", read from the trainer's own definitions (run_dir.complete_checkpoints, load_recipe).
run_progress() {
  "${PYTHON}" - "${ROOT}" "${ROOT}/${RECIPE}" "${RUN_DIR}" "${overrides[@]}" <<'EOF'
import sys
root, recipe, run_dir, *overrides = sys.argv[1:]
sys.path.insert(0, root)
from megatron_credit.recipe.config import load_recipe
from megatron_credit.run_dir import complete_checkpoints
done = complete_checkpoints(run_dir)
r = load_recipe(recipe, overrides=overrides)
print(done[-1][0] if done else 0, r.train.steps, r.model.lora.rank)
EOF
}
progress=$(run_progress)
read -r at steps lora_rank <<<"${progress##*$'\n'}"   # its last line: an import may print above it
if (( at < steps )); then
  echo "not exporting: ${RUN_DIR} is at iteration ${at} of ${steps} (pre-empted?); resubmit to continue"
  exit 0
fi
export_cmd=("${PYTHON}" "${ROOT}/tools/export_run_to_hf.py" --run-dir "${RUN_DIR}" --out "${EXPORT_DIR}")
if [[ "${DRY_RUN}" == 1 ]]; then echo "export: ${export_cmd[*]}"; else "${export_cmd[@]}"; fi
if (( lora_rank > 0 )); then  # the adapters alone too, for peft or vLLM's LoRA serving on the base
  adapter_cmd=("${export_cmd[@]:0:4}" --out "${ADAPTER_DIR}" --adapter)
  if [[ "${DRY_RUN}" == 1 ]]; then echo "export: ${adapter_cmd[*]}"; else "${adapter_cmd[@]}"; fi
fi
