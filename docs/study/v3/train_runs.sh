#!/usr/bin/env bash
# The 15 runs of docs/study/plan-v3.md: seeds 0-4 of PreNorm, Full and Block, 8,000 steps each,
# two at a time with one thread each, seed by seed. Each run resumes from its saved state, and a
# finished run is skipped, so this script continues where the last session stopped.
#   bash docs/study/v3/train_runs.sh            # from the repository root
set -uo pipefail
cd "$(dirname "$0")/../../.."
PROBE=${PROBE:-.venv/bin/attnres-probe}
export NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
RUNS=()
for seed in 0 1 2 3 4; do for model in prenorm full block; do RUNS+=("$model $seed"); done; done

finished() {  # the run's log says it reached step 8000
  python3 - "$1/train_log.json" <<'PY'
import json, sys
try:
    log = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(1)
sys.exit(0 if log.get("finished") and log.get("step") == 8000 else 1)
PY
}

run_one() {
  local model=$1 seed=$2 out=docs/study/v3/runs/$1/seed$2
  if finished "$out"; then echo "done already: $model seed $seed"; return 0; fi
  local again=()
  [ -f "$out/train_state.json" ] && again=(--resume)
  mkdir -p "$out"
  echo "$(date -u +%FT%TZ) start $model seed $seed ${again[*]}"
  "$PROBE" train --residual "$model" --seed "$seed" --steps 8000 --corpus shakespeare --split plays \
    --eval-every 500 --probe-every 250 --backend numba --quiet --out "$out" "${again[@]}"
  echo "$(date -u +%FT%TZ) end $model seed $seed: exit $?"
}

worker() {  # every second run, starting at $1
  for ((i = $1; i < ${#RUNS[@]}; i += 2)); do run_one ${RUNS[$i]}; done
}

worker 0 &
worker 1 &
wait
