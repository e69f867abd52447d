#!/bin/bash
# Generation speed of an older commit's engine against the working tree's, `dflash bench` runs alternating between
# the two, with the same drafters (the old commit's shipped ones, so that only the engine differs).
#
# Usage: scripts/ab_commits.sh OLD_COMMIT DATASET LIMIT [ROUNDS=2] [THREADS=1] [METHODS=ar,dflash,eagle3] [DTYPE=float32]
# Writes runs/ab_commits/THREADS_DATASET_{old,new}_ROUND/ (bench JSON, plots) and prints each run's table rows.
#
# The old commit runs from a git worktree (/tmp/dflash-ab-OLD) with its own copy of the timing cache, from which
# the load-time timings of newer formats are dropped: each version measures its own pass costs at load.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 dataset=$2 limit=$3 rounds=${4:-2} threads=${5:-1} methods=${6:-ar,dflash,eagle3} dtype=${7:-float32}
tree=/tmp/dflash-ab-$old cache=/tmp/dflash-ab-cache-$old out=runs/ab_commits
[ -d "$tree" ] || git worktree add -f "$tree" "$old" -q
if [ ! -d "$cache" ]; then
  mkdir -p "$cache"
  src=${DFLASH_CACHE:-$HOME/.cache/dflash}
  for d in gguf hf native wheels; do [ -e "$src/$d" ] && ln -sfn "$src/$d" "$cache/$d"; done
  .venv/bin/python - "$src/kernel_plans.json" "$cache/kernel_plans.json" <<'EOF'
import json, sys
from pathlib import Path
plans = json.loads(Path(sys.argv[1]).read_text()) if Path(sys.argv[1]).exists() else {}
old_format = {k: v for k, v in plans.items() if not (isinstance(v, dict) and ("relative" in v or "step_ms" in v))}
Path(sys.argv[2]).write_text(json.dumps(old_format))
EOF
fi
drafter=$tree/src/dflash/drafters/smollm2-135m-dflash
mkdir -p $out
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    run=$out/${threads}_${dtype}_${dataset}_${v}_$r
    if [ $v = old ]; then env=(PYTHONPATH=$tree/src DFLASH_CACHE=$cache); else env=(); fi
    env "${env[@]}" OMP_NUM_THREADS=$threads .venv/bin/dflash bench --threads "$threads" --dataset "$dataset" \
      --limit "$limit" --methods "$methods" --max-new-tokens 128 --drafter "dflash=$drafter" --dtype "$dtype" --no-progress \
      --out "$run" > "$run.log" 2>&1
    grep -E "^\| *[a-z]" "$run.log" | grep -v "^| method" | sed "s/^/$v $r /"
  done
done
