#!/usr/bin/env bash
# GPU check of the depth-attention kernels, in one command, from the repository root:
#
#     bash benchmarks/gpu_check.sh [results.md]      # default benchmarks/results/gpu_check.md
#
# 1. runs the kernel tests on CUDA (tests/kernels, TRITON_INTERPRET unset, so the Triton
#    kernels are compiled for the GPU instead of interpreted);
# 2. runs benchmarks/kernels.py on its default GPU grid (M=16384, S in {5, 9, 17},
#    d in {1024, 2048}, bf16), which re-checks correctness per shape before timing;
# 3. writes one markdown file: the test summary, then the benchmark table.
#
# Uses .venv/bin/python when it exists, else `python` on PATH. Each step has its own time
# limit (150 s + 240 s) so the whole check stays under 5 minutes on one GPU; a step that runs
# out of time still leaves what it measured. Exit status: 0 when both steps passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-benchmarks/results/gpu_check.md}"
PY=.venv/bin/python
[ -x "$PY" ] || PY=python
unset TRITON_INTERPRET
mkdir -p "$(dirname "$OUT")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA device visible to $PY; run it on a GPU machine" >&2
    exit 2
fi
"$PY" -c "import attnres_probe.kernels" 2>/dev/null || "$PY" -m pip install -q -e . --no-deps

echo "== kernel tests on CUDA"
timeout 150 "$PY" -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$TMP/tests.txt"
TEST_RC=${PIPESTATUS[0]}

echo "== benchmark"
timeout 240 "$PY" benchmarks/kernels.py --out "$TMP/bench.md" 2>&1 | tee "$TMP/bench.txt"
BENCH_RC=${PIPESTATUS[0]}

{
    echo "# Depth-attention GPU check"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'); $("$PY" -c 'import torch, triton; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)')"
    echo
    echo "## Kernel tests (pytest tests/kernels, CUDA, exit status $TEST_RC)"
    echo
    echo '```'
    grep -E "passed|failed|error|FAILED|ERROR" "$TMP/tests.txt" | tail -n 30
    [ "$TEST_RC" = 124 ] && echo "(stopped by the 150 s limit)"
    echo '```'
    echo
    echo "## Benchmark (benchmarks/kernels.py, exit status $BENCH_RC)"
    echo
    if [ -s "$TMP/bench.md" ]; then cat "$TMP/bench.md"; else echo "no results"; fi
    [ "$BENCH_RC" = 124 ] && echo && echo "(stopped by the 240 s limit; the table holds the shapes measured before that)"
} > "$OUT"
echo "== results written to $OUT"

[ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
