#!/usr/bin/env bash
# `make gpu-wheelhouse`: where the package registries are, download what tools/gpu_check.sh needs on the
# offline GPU machine beyond that machine's own packages (tools/gpu_wheelhouse.txt; the machine's list is
# tools/gpu_machine_packages.txt) into an ignored folder that travels with the working tree. Wheels only,
# for CPython 3.12 on manylinux x86-64, each without its dependencies (tools/gpu_wheelhouse.py checks them
# against the two lists). Prints each wheel's size and the total; fails above 60 MiB.
#
# Usage: tools/gpu_wheelhouse.sh [DIR]   (default .cache/gpu_wheelhouse). Environment: PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.cache/gpu_wheelhouse}
PY=${PYTHON:-python3}
"$PY" tools/gpu_wheelhouse.py check-recipe
rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download --quiet --disable-pip-version-check --dest "$DIR" --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -r tools/gpu_wheelhouse.txt
"$PY" tools/gpu_wheelhouse.py check-dir "$DIR"
echo "wheelhouse: $DIR (carry it to the GPU machine with the working tree; tools/gpu_check.sh installs it offline)"
