#!/usr/bin/env bash
# GPU check of the depth-attention kernels beside every public AttnRes kernel, in one command,
# from the repository root, in under 8 minutes on one GPU (issue #20):
#
#     bash benchmarks/gpu_check.sh [results.md]      # default benchmarks/results/gpu_check.md
#
# 0. installs the wheels in .whl/ if that folder came with the tree (pip --no-index --no-deps
#    into /tmp/attnres-site; nothing is downloaded), then this checkout without its
#    dependencies if `attnres_probe` is not importable;
# 1. runs the kernel tests on CUDA (tests/kernels, TRITON_INTERPRET unset, so the Triton
#    kernels are compiled for the GPU instead of interpreted; four pytest-xdist workers where
#    xdist is installed, as on the CUDA image), at most 100 s;
# 2. runs benchmarks/gpu_peers.py: ours vs the eager reference vs torch.compile of it vs each
#    peer of the `gpu` extra (fla-core, fast-attnres, flash-attn-res), every implementation
#    checked against the float32 reference before it is timed; the Block path of a 24-layer
#    model; end-to-end training-step and recording ratios. It starts no new shape after 260 s
#    and is stopped at 300 s (what it measured by then is kept);
# 3. runs benchmarks/gpu_fla.py (issue #19): a small fla transformer on CUDA with fla's real
#    fused kernels, checked against load_pretrained and watch in float32 and bf16, at most 60 s;
# 4. writes one markdown file: the test summary, then gpu_peers.py's and gpu_fla.py's tables.
#
# A GPU machine without network gets the packages it lacks as wheels. Here, with network:
#
#     bash benchmarks/gpu_check.sh --fetch-wheels    # fills .whl/ (ignored by git) for Python 3.12
#
# then let .whl travel with the tree. The wheels are the `gpu` extra (pinned in pyproject.toml)
# and the model's import-time dependencies that the CUDA image lacks (transformer-lens and what
# it imports: datasets, dill, multiprocess); the GPU check itself installs nothing else.
#
# Uses .venv/bin/python when it exists, else python3 (or $PYTHON). Exit status: 0 when every
# step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_EXTRA=(fla-core==0.6.0 fast-attnres==2.1.0 flash-attn-res==0.1.12)
MODEL_DEPS=(transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
# gpu_fla.py (issue #19): fla's models and what they import, at the versions the CPU tests use
FLA_DEPS=(flash-linear-attention==0.6.0 transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 einops==0.8.2)

if [ "${1:-}" = "--fetch-wheels" ]; then
    PIP_PY=.venv/bin/python
    [ -x "$PIP_PY" ] || PIP_PY=python3
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    exec "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${GPU_EXTRA[@]}" "${MODEL_DEPS[@]}" "${FLA_DEPS[@]}"
fi

OUT="${1:-benchmarks/results/gpu_check.md}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
mkdir -p "$(dirname "$OUT")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA device visible to $PY; run it on a GPU machine" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing .whl/*.whl into /tmp/attnres-site (no index, no dependencies)"
    for whl in .whl/*.whl; do  # one by one: a wheel that does not fit this Python leaves the others
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/attnres-site "$whl" 2>&1 \
            | grep -v "already exists" || true
    done
    export PYTHONPATH="/tmp/attnres-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import attnres_probe.kernels" 2>/dev/null \
    || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$PY" -c "import transformer_lens" 2>"$TMP/tl.txt" \
    || echo "gpu_check.sh: transformer_lens does not import ($(tail -n 1 "$TMP/tl.txt")); the end-to-end rows will say so" >&2

echo "== kernel tests on CUDA"
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
timeout 100 "$PY" -m pytest tests/kernels -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} 2>&1 | tee "$TMP/tests.txt"
TEST_RC=${PIPESTATUS[0]}

echo "== gpu_peers.py"
timeout 300 "$PY" benchmarks/gpu_peers.py --budget-s 260 --out "$TMP/peers.md" 2>&1 | tee "$TMP/peers.txt"
PEERS_RC=${PIPESTATUS[0]}

echo "== gpu_fla.py"
timeout 60 "$PY" benchmarks/gpu_fla.py --out "$TMP/fla.md" 2>&1 | tee "$TMP/fla.txt"
FLA_RC=${PIPESTATUS[0]}

{
    echo "# Depth-attention GPU check"
    echo
    echo "## Kernel tests (pytest tests/kernels, CUDA, exit status $TEST_RC)"
    echo
    echo '```'
    grep -E "passed|failed|error|FAILED|ERROR" "$TMP/tests.txt" | tail -n 30
    [ "$TEST_RC" = 124 ] && echo "(stopped by the 100 s limit)"
    echo '```'
    echo
    echo "## GPU peers (benchmarks/gpu_peers.py, exit status $PEERS_RC)"
    echo
    if [ -s "$TMP/peers.md" ]; then cat "$TMP/peers.md"; else echo "no results"; tail -n 20 "$TMP/peers.txt"; fi
    [ "$PEERS_RC" = 124 ] && echo && echo "(stopped by the 300 s limit; the tables hold what was measured before that)"
    echo
    echo "## fla models (benchmarks/gpu_fla.py, exit status $FLA_RC)"
    echo
    if [ -s "$TMP/fla.md" ]; then cat "$TMP/fla.md"; else echo "no results"; tail -n 20 "$TMP/fla.txt"; fi
} > "$OUT"
echo "== results written to $OUT"

[ "$TEST_RC" = 0 ] && [ "$PEERS_RC" = 0 ] && [ "$FLA_RC" = 0 ]
