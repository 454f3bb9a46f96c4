#!/usr/bin/env bash
# On a machine with a CUDA GPU (and the project installed in .venv): the kernel tests compiled for
# the GPU, both attention backends on the default model, and GPU figures. Budget: under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
timeout 240 "$PY" -m pytest -q tests/test_triton_kernels.py
timeout 240 "$PY" scripts/gpu_check.py
