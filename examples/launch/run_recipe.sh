#!/usr/bin/env bash
# Download (if needed) -> train on NNODES nodes -> export the last checkpoint to a Hugging Face folder.
# Called by the per-recipe scripts (examples/<recipe>.sh) on every node, with the torchrun.sh environment
# (NNODES, NODE_RANK, MASTER_ADDR, ...) or inside slurm.sbatch's srun (LAUNCHER=slurm).
#
#   RECIPE    examples/<recipe>.yaml                         (set by the per-recipe script)
#   MODEL_ID  the Hugging Face id                            (set by the per-recipe script)
#   MODEL_DIR local folder of the HF checkpoint              (default /models/<last part of MODEL_ID>)
#   DATA_DIR  folder with dapo-math-17k.parquet, aime-2024.parquet   (default /data)
#   RUN_DIR   output folder                                  (default runs/<recipe>)
#   EXPORT_DIR  HF export of the trained policy              (default RUN_DIR/hf)
#
# The trainer reads the HF safetensors directly and shards them on load (no conversion step); the
# result is exported from the run's newest checkpoint with tools/export_run_to_hf.py. Extra arguments
# are recipe overrides (key.sub=value). DRY_RUN=1: plan, then print the torchrun and export commands.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${RECIPE:?set RECIPE}" "${MODEL_ID:?set MODEL_ID}"
name=$(basename "${RECIPE}" .yaml)
MODEL_DIR=${MODEL_DIR:-/models/${MODEL_ID##*/}}
DATA_DIR=${DATA_DIR:-/data}
RUN_DIR=${RUN_DIR:-runs/${name}}
EXPORT_DIR=${EXPORT_DIR:-${RUN_DIR}/hf}
PYTHON=${PYTHON:-python}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then   # under srun: the first host
  export MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
fi
if [[ ! -f "${MODEL_DIR}/config.json" ]]; then
  if [[ "${NODE_RANK}" == 0 ]]; then   # a shared file system is assumed: one download
    huggingface-cli download "${MODEL_ID}" --local-dir "${MODEL_DIR}"
  else
    while [[ ! -f "${MODEL_DIR}/config.json" ]]; do sleep 10; done
  fi
fi
overrides=("model.name_or_path=${MODEL_DIR}" "data.train_path=${DATA_DIR}/dapo-math-17k.parquet"
           "data.val_path=${DATA_DIR}/aime-2024.parquet" "$@")
"${PYTHON}" "${ROOT}/tools/plan.py" --config "${ROOT}/${RECIPE}" --nodes "${NNODES:-1}" \
  --gpus-per-node "${GPUS_PER_NODE:-8}" "${overrides[@]}"
"${ROOT}/examples/launch/torchrun.sh" --config "${ROOT}/${RECIPE}" --output-dir "${RUN_DIR}" "${overrides[@]}"
if [[ "${NODE_RANK}" == 0 ]]; then
  export_cmd=("${PYTHON}" "${ROOT}/tools/export_run_to_hf.py" --run-dir "${RUN_DIR}" --out "${EXPORT_DIR}")
  if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "export: ${export_cmd[*]}"; else "${export_cmd[@]}"; fi
fi
