#!/usr/bin/env bash
# Plan a recipe, then submit examples/launch/slurm.sbatch with the warning lead the plan prints for it:
#
#   examples/launch/submit.sh --nodes N --config R.yaml [--output-dir D] [other pretrain_rl.py arguments]
#
# runs `python tools/plan.py --config R.yaml --nodes N --gpus-per-node G [--output-dir D] [overrides]`,
# reads the lead from its "sbatch --signal=USR1@<seconds>" line (one iteration plus one save, so the
# trainer's pre-emption checkpoint lands before the time limit), and calls
#
#   sbatch --signal=USR1@<lead> --nodes N [--gpus-per-node G] examples/launch/slurm.sbatch <the arguments>
#
# The arguments other than --nodes N go to pretrain_rl.py unchanged (they must include --config). Nothing is
# submitted when the plan fails: exit 1 when the recipe does not fit, 2 on a user error or a failed
# preflight (the model, the data or the run folder's disk; PLAN_ARGS=--skip-preflight plans without them, on
# a login node that does not see them). Environment: GPUS_PER_NODE (default 8, slurm.sbatch's; when set, it
# is also passed to sbatch), PLAN_ARGS (extra tools/plan.py options, split on spaces, e.g. "--disk-gbps 2":
# the save time is part of the lead), PYTHON (python), REPO (this checkout; exported for slurm.sbatch, which
# finds torchrun.sh there). Other sbatch options: the SBATCH_* environment variables (SBATCH_TIMELIMIT,
# SBATCH_PARTITION, ...). DRY_RUN=1 prints the sbatch command instead of running it.
set -euo pipefail
trap '' USR1   # as every launcher of the project (see slurm.sbatch): USR1 is the trainer's
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON=${PYTHON:-python}
read -r -a plan_args <<<"${PLAN_ARGS:-}"   # used as ${plan_args[@]+...}: bash < 4.4 calls an empty array unset

usage() { echo "usage: $0 --nodes N --config R.yaml [pretrain_rl.py arguments]" >&2; exit 2; }
nodes="" config="" output_dir=""
train_args=() overrides=()
while (( $# )); do
  case "$1" in
    --nodes) (( $# > 1 )) || usage; nodes=$2; shift 2 ;;
    --nodes=*) nodes=${1#*=}; shift ;;
    --config) (( $# > 1 )) || usage; config=$2; train_args+=("$1" "$2"); shift 2 ;;
    --output-dir) (( $# > 1 )) || usage; output_dir=$2; train_args+=("$1" "$2"); shift 2 ;;
    --resume|--plugin) (( $# > 1 )) || usage; train_args+=("$1" "$2"); shift 2 ;;   # the others with a value
    --config=*) config=${1#*=}; train_args+=("$1"); shift ;;
    --output-dir=*) output_dir=${1#*=}; train_args+=("$1"); shift ;;
    -*) train_args+=("$1"); shift ;;
    *) overrides+=("$1"); train_args+=("$1"); shift ;;   # key.sub=value
  esac
done
[[ "${nodes}" =~ ^[1-9][0-9]*$ && -n "${config}" ]] || usage

plan=("${PYTHON}" "${ROOT}/tools/plan.py" --config "${config}" --nodes "${nodes}"
      --gpus-per-node "${GPUS_PER_NODE:-8}")
[[ -z "${output_dir}" ]] || plan+=(--output-dir "${output_dir}")
rc=0
plan_out=$("${plan[@]}" ${plan_args[@]+"${plan_args[@]}"} ${overrides[@]+"${overrides[@]}"}) || rc=$?
[[ -z "${plan_out}" ]] || echo "${plan_out}"
if (( rc != 0 )); then
  echo "error: the plan of ${config} on ${nodes} node(s) failed (exit ${rc}); not submitting" >&2
  exit "${rc}"
fi
# Only the `--signal=USR1@<digits>` part is matched: the lines around it may change.
if [[ ! "${plan_out}" =~ --signal=USR1@([0-9]+) ]]; then
  echo "error: the plan printed no 'sbatch --signal=USR1@<seconds>' line; not submitting" >&2
  exit 2
fi
lead=${BASH_REMATCH[1]}
if (( lead > 65535 )); then   # sbatch refuses a --signal time over 65535 s
  echo "error: the plan's lead, ${lead} s, is over Slurm's 65535 s for --signal; not submitting (see the plan's line)" >&2
  exit 2
fi

export REPO=${REPO:-${ROOT}}
cmd=(sbatch "--signal=USR1@${lead}" --nodes "${nodes}")
[[ -z "${GPUS_PER_NODE:-}" ]] || cmd+=(--gpus-per-node "${GPUS_PER_NODE}")
cmd+=("${ROOT}/examples/launch/slurm.sbatch" ${train_args[@]+"${train_args[@]}"})
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "submit: REPO=${REPO} ${cmd[*]}"
else
  "${cmd[@]}"
fi
