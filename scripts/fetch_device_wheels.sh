#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels a lent GPU machine lacks: the CUTLASS/CuTe headers, CCCL 13.0
# (newer CCCL breaks CuTe under NVRTC), and Optuna with the dependencies its image lacks (for `flash-gen tune`).
# Carry .whl to the device; scripts/device_check.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85 optuna==5.0.0 alembic sqlalchemy colorlog mako
ls .whl
