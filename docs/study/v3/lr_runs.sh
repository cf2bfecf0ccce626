#!/usr/bin/env bash
# The learning-rate check of issue #49 (exploratory): PreNorm, Full and Block at peak learning
# rates 1e-3 and 6e-3, seed 0, otherwise the v3 recipe (8,000 steps, whole plays held out), beside
# the 3e-3 runs of docs/study/v3/runs. One run at a time on one thread (WORKERS=2 for two);
# each run resumes from its saved state and a finished run is skipped, so the script continues
# where the last session stopped.
#   bash docs/study/v3/lr_runs.sh            # from the repository root
set -uo pipefail
cd "$(dirname "$0")/../../.."
PROBE=${PROBE:-.venv/bin/attnres-probe}
WORKERS=${WORKERS:-1}
export NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
RUNS=()
for lr in 1e-3 6e-3; do for model in prenorm full block; do RUNS+=("$model $lr"); done; done

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
  local model=$1 lr=$2 out=docs/study/v3/lr/$1/lr$2/seed0
  if finished "$out"; then echo "done already: $model lr $lr"; return 0; fi
  local again=()
  [ -f "$out/train_state.json" ] && again=(--resume)
  mkdir -p "$out"
  echo "$(date -u +%FT%TZ) start $model lr $lr ${again[*]}"
  "$PROBE" train --residual "$model" --seed 0 --lr "$lr" --steps 8000 --corpus shakespeare --split plays \
    --eval-every 500 --probe-every 250 --backend numba --quiet --out "$out" "${again[@]}"
  echo "$(date -u +%FT%TZ) end $model lr $lr: exit $?"
}

worker() {  # every WORKERS-th run, starting at $1
  for ((i = $1; i < ${#RUNS[@]}; i += WORKERS)); do run_one ${RUNS[$i]}; done
}

for ((w = 0; w < WORKERS; w++)); do worker "$w" & done
wait
