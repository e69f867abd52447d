# The call after train.sh launched its runs (or train.sh itself, when its call waits for them): wait for each run's
# final drafter until the window's end (train.sh wrote it in $ROOT/deadline), send every run back through $OUT
# (fetch.sh: RUN.tar.partNN), then the CUDA tests' log where train.sh ran them (TESTS=1), as cuda-tests.txt.
set -uo pipefail
: "${OUT:?OUT (the folder that comes back) is required}"
ROOT=${ROOT:-/root}
[ -f "$ROOT/deadline" ] || { echo "no runs to collect: $ROOT/deadline is missing (did train.sh run here?)"; exit 2; }
deadline=$(cat "$ROOT/deadline")
failed=0
for run in $(cat "$ROOT/runs"); do
  RUN=$run GIVEUP=$(( deadline + 25 )) OUT="$OUT" bash scripts/lease/fetch.sh || failed=1
done
if [ -f "$ROOT/cuda-tests.pid" ]; then  # they end by the window's end (their LIMIT)
  while kill -0 "$(cat "$ROOT/cuda-tests.pid")" 2>/dev/null; do sleep 2; done
  cat "$ROOT/cuda-tests.out"
  cp "$ROOT/cuda-tests.txt" "$OUT/" 2>/dev/null || echo "the CUDA tests left no log"
fi
exit $failed
