#!/usr/bin/env bash
# GPU check for asyncpage on a CUDA machine with no network (run from anywhere: `bash .gpu/run.sh` after scripts/gpu_offline/prepare.sh).
#   1. environment report (GPU, python, versions of the preinstalled packages, glibc)
#   2. the wheels in .gpu/wheels that the remote python lacks -> pip --target .gpu/site (on PYTHONPATH;
#      nothing preinstalled is replaced or shadowed)
#   3. asyncpage itself: pip install -e . (offline, --no-build-isolation, setuptools from .gpu/tools);
#      if that fails, the repo on PYTHONPATH with asyncpage/kernels and asyncpage/grammars symlinked
#      (the package-dir mapping of pyproject.toml), removed again at exit
#   4. timeout 240 pytest tests/test_triton_kernels.py (compiled for the GPU)
#   5. .gpu/engine_check.py: tiny random models, greedy float32 tokens of the torch and triton attention
#      backends, with and without n-gram speculation, against each other and transformers
# Logs and results go to $OUT (default .gpu/out). Exit status: 0 only if steps 3-5 all passed.
# DRY_RUN=1 (a local try of the install steps, no GPU needed): steps 1-3 only.
set -uo pipefail
cd "$(dirname "$0")" && until [ -f pyproject.toml ] || [ "$PWD" = / ]; do cd ..; done  # .gpu/ or scripts/gpu_offline/
REPO=$PWD
OUT=${OUT:-$REPO/.gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1
PY=${PY:-python3}
SITE=$REPO/.gpu/site
TOOLS=$REPO/.gpu/build-tools
CREATED_LINKS=()

cleanup() {
    for l in ${CREATED_LINKS[@]+"${CREATED_LINKS[@]}"}; do [ -L "$l" ] && rm -f "$l"; done
}

main() {
    trap cleanup EXIT  # main runs in a subshell (piped into tee): its own trap sees its CREATED_LINKS
    set -x
    local t0=$SECONDS rc_install=0 rc_pytest=0 rc_engine=0

    # ---- 1. environment ------------------------------------------------------------------------
    nvidia-smi || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
    command -v "$PY"; "$PY" -V
    ldd --version 2>&1 | head -1
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], platform.machine(), "prefix", sys.prefix)
for d in ("torch", "triton", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy", "anyio",
          "pytest", "pytest-asyncio", "pytest-xdist", "pytest-timeout", "setuptools", "pip", "jinja2", "tqdm",
          "typing_extensions", "msgspec", "sniffio", "llguidance", "xgrammar", "gguf", "jsonschema", "google-re2"):
    try:
        print(f"  {d:18s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"  {d:18s} (not installed)")
try:
    import torch
    print("torch.cuda.is_available():", torch.cuda.is_available(), "| CUDA", torch.version.cuda,
          "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
except Exception as exc:
    print("torch import failed:", exc)
try:
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        print("WARNING: transformers", transformers.__version__, "< 5: asyncpage and the tiny configs need >= 5")
except Exception as exc:
    print("transformers import failed:", exc)
EOF
    [ "${DRY_RUN:-0}" = 1 ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "FATAL: torch sees no CUDA device; not running the checks (the kernel tests would fall back to the slow interpreter)"
        return 2
    }

    # pip: the remote python's own, else the one in .gpu/tools (a wheel runs as a zip)
    local PIP
    if "$PY" -m pip --version; then PIP=("$PY" -m pip); else PIP=("$PY" "$(ls "$REPO"/.gpu/tools/pip-*.whl | tail -1)/pip"); "${PIP[@]}" --version; fi

    # ---- 2. the missing wheels -> .gpu/site ------------------------------------------------------
    local missing
    missing=$("$PY" - "$REPO/.gpu/wheels" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    dist = w.name.split("-")[0]
    try:
        print(f"have  {dist} {md.version(dist)} (wheel {w.name.split('-')[1]} not installed)", file=sys.stderr)
    except md.PackageNotFoundError:
        print(f"needs {dist} {w.name.split('-')[1]}", file=sys.stderr)
        print(re.sub("_", "-", dist))
EOF
)
    if [ -n "$missing" ]; then
        # All at once; if that fails (say llguidance's manylinux_2_31 wheel on an older glibc), one by one
        # so that the others still go in.
        # shellcheck disable=SC2086
        if ! "${PIP[@]}" install --no-index --no-deps --find-links "$REPO/.gpu/wheels" --target "$SITE" $missing \
                > "$OUT/pip-wheels.log" 2>&1; then
            cat "$OUT/pip-wheels.log"
            for w in $missing; do
                "${PIP[@]}" install --no-index --no-deps --find-links "$REPO/.gpu/wheels" --target "$SITE" "$w" \
                    >> "$OUT/pip-wheels.log" 2>&1 || { echo "FAILED to install $w"; rc_install=1; }
            done
        fi
        tail -3 "$OUT/pip-wheels.log"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

    # ---- 3. asyncpage itself ---------------------------------------------------------------------
    "${PIP[@]}" install --no-index --no-deps --target "$TOOLS" "$REPO"/.gpu/tools/setuptools-*.whl \
        > "$OUT/pip-setuptools.log" 2>&1 || cat "$OUT/pip-setuptools.log"
    if PYTHONPATH="$TOOLS:$PYTHONPATH" "${PIP[@]}" install --no-index --no-deps --no-build-isolation -e "$REPO" \
            > "$OUT/pip-editable.log" 2>&1; then
        echo "asyncpage: editable install OK"
    else
        tail -20 "$OUT/pip-editable.log"
        echo "asyncpage: editable install failed; the repo on PYTHONPATH, kernels/ and grammars/ linked into asyncpage/"
        for d in kernels grammars; do
            if [ ! -e "asyncpage/$d" ]; then ln -s "../$d" "asyncpage/$d" && CREATED_LINKS+=("$REPO/asyncpage/$d"); fi
        done
        export PYTHONPATH="$REPO:$PYTHONPATH"
    fi
    (cd /tmp && "$PY" -c "
import asyncpage, asyncpage.kernels, asyncpage.engine, msgspec, sniffio, llguidance
print('import OK: asyncpage', asyncpage.__file__, '| kernels', asyncpage.kernels.__file__,
      '| msgspec', msgspec.__version__, '| llguidance', llguidance.__file__)
for m in ('jsonschema', 're2', 'gguf'):
    try:
        __import__(m); print('  optional', m, 'OK')
    except Exception as exc:
        print('  optional', m, 'not importable:', exc)
") || rc_install=1
    "${PIP[@]}" list --format=freeze > "$OUT/pip-list.txt" 2>/dev/null || true
    ls "$SITE" > "$OUT/site-contents.txt" 2>/dev/null || true
    echo "install: $((SECONDS - t0)) s"
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "DRY_RUN: install steps only"; return $rc_install; fi

    # ---- 4. the Triton kernel tests, compiled for the GPU ------------------------------------------
    local t1=$SECONDS
    timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rfEs --junitxml="$OUT/pytest-triton.xml" \
        tests/test_triton_kernels.py 2>&1 | tee "$OUT/pytest-triton.log"
    rc_pytest=${PIPESTATUS[0]}
    echo "pytest tests/test_triton_kernels.py: rc $rc_pytest in $((SECONDS - t1)) s"

    # ---- 5. the engine on tiny models: torch vs triton, +/- n-gram speculation ------------------------
    local t2=$SECONDS left=$((350 - (SECONDS - t0)))
    [ "$left" -lt 100 ] && left=100
    timeout "$left" "$PY" .gpu/engine_check.py --bf16 --budget-s $((left - 45)) --json "$OUT/engine_check.json" \
        2>&1 | grep --line-buffered -v "Writing model shards" | tee "$OUT/engine_check.log"
    rc_engine=${PIPESTATUS[0]}
    echo "engine_check: rc $rc_engine in $((SECONDS - t2)) s (limit $left s)"

    set +x
    echo "================ SUMMARY ================"
    echo "install (wheels + asyncpage + imports): $([ $rc_install = 0 ] && echo OK || echo FAILED)"
    echo "pytest tests/test_triton_kernels.py:   rc $rc_pytest ($(tail -1 "$OUT/pytest-triton.log"))"
    echo "engine_check (tiny models, CUDA):      rc $rc_engine ($(grep 'ENGINE CHECK' "$OUT/engine_check.log" | tail -1))"
    echo "total: $((SECONDS - t0)) s; logs in $OUT"
    [ $rc_install = 0 ] && [ "$rc_pytest" = 0 ] && [ "$rc_engine" = 0 ]
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
