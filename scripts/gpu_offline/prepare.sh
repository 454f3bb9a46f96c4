#!/usr/bin/env bash
# The GPU check for a CUDA machine without network whose python (3.12) has torch, triton and transformers
# but not asyncpage's other dependencies (the device machines lent here): fills .gpu/ (git-ignored through
# .git/info/exclude) with this folder's run.sh and engine_check.py and the wheels that python lacks, then run
#   bash .gpu/run.sh          (there, with .gpu carried: Triton kernel tests compiled for the GPU, and
#                              greedy tokens of the torch / triton backends, with and without n-gram
#                              speculation, on tiny random models of every architecture against transformers)
# scripts/gpu_check.sh is the check for a machine where the project installs normally.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/wheels .gpu/tools
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
cp scripts/gpu_offline/run.sh scripts/gpu_offline/engine_check.py .gpu/
PIP=(.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_31_x86_64 -d)
for pkg in msgspec sniffio llguidance gguf jsonschema attrs referencing rpds-py jsonschema-specifications google-re2; do
    version=$(.venv/bin/pip show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')
    "${PIP[@]}" .gpu/wheels "$pkg${version:+==$version}"
done
"${PIP[@]}" .gpu/tools pip setuptools
du -sh .gpu
