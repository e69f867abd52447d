# One call that trains and brings the drafters back (carry the last GGUF part, or call after the call that did):
# launch.sh, then fetch.sh in the SAME call. The machine goes back after 30 s without a call, and a gap that long
# between polls (a slow reply on this side is enough) loses a run and everything it learned: the thirty-fourth
# session lost ~960 steps that way. WINDOW: seconds from now by which the runs must have ended (the call's timeout_s
# must be at least WINDOW + 40, and 600 at most); each run sizes itself to it (`dflash train --minutes`); the other
# variables are launch.sh's.
# RUNS: the runs' names, side by side on the one GPU (default: one, `run`); FLAGS_<name> adds flags to that run only,
# NPROC_<name> gives it that many processes (one drafter, data-parallel over gloo: launch.sh's NPROC).
# An A/B at equal GPU time: RUNS="ce kl" FLAGS_kl="--loss kl" (both from the same warm start, seed and corpus order).
# One drafter on two processes beside a lone one: RUNS="a b" NPROC_b=2 FLAGS_b="--grad-accum 16" (b: twice a's batch,
# each of its processes the step's 8 sequences a lone run takes).
# Each comes back as $OUT/<name>.tar.partNN (fetch.sh), two files a run: four runs at most (three with TESTS=1).
# TESTS=1: the CUDA tests (cuda_tests.sh) beside the runs, started first so that each run's pace is timed with them
# there (a run that slows down after its pace was timed stops short of its annealed end); their log comes back as
# $OUT/cuda-tests.txt, and the bench call after this one can leave them out (bench.sh's TESTS=0).
# CPU check at tiny scale: PATH=$PWD/.venv/bin:$PATH DEVICE=cpu DTYPE=float32 ANCHORS=8 ACCUM=1 \
#   WINDOW=40 ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/train.sh
set -uo pipefail
: "${OUT:?OUT (the folder that comes back) is required}"
WINDOW=${WINDOW:-520}; RUNS=${RUNS:-run}; runs=$(echo $RUNS | wc -w)
[ "$runs" -le $(( ${TESTS:-0} = 1 ? 3 : 4 )) ] ||
  { echo "RUNS: four runs at most, three with TESTS=1 (\$OUT brings back 8 files, two a run)"; exit 2; }
export DEADLINE=$(( $(date +%s) + WINDOW ))
# side by side, each process's torch takes its share of the cores: a process's idle threads spin for a while after each
# parallel operation, and on cores the other run's host work needs (both steps are partly bound by their host)
processes=0
for run in $RUNS; do  # every name checked before any run starts
  [[ "$run" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { echo "RUNS: '$run' is not a name (letters, digits, _)"; exit 2; }
  nproc_of="NPROC_$run"; n=${!nproc_of:-${NPROC:-1}}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "$nproc_of: '$n' is not a number of processes"; exit 2; }
  processes=$(( processes + n ))
done
share=$(( $(nproc) / processes > 0 ? $(nproc) / processes : 1 ))
[ "$processes" -gt 1 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}
if [ "${TESTS:-0}" = 1 ]; then
  mkdir -p "$OUT" "${ROOT:-/root}"
  LOG="$OUT/cuda-tests.txt" LIMIT=$(( WINDOW - 20 )) OMP_NUM_THREADS=2 TORCHINDUCTOR_COMPILE_THREADS=4 \
    bash scripts/lease/cuda_tests.sh > "${ROOT:-/root}/cuda-tests.out" 2>&1 &
  tests=$!
fi
for run in $RUNS; do
  extra="FLAGS_$run"; nproc_of="NPROC_$run"
  RUN=$run NPROC=${!nproc_of:-${NPROC:-1}} FLAGS="$(echo ${FLAGS:-} ${!extra:-})" bash scripts/lease/launch.sh ||
    exit $?
done
failed=0
for run in $RUNS; do
  RUN=$run GIVEUP=$(( DEADLINE + 25 )) OUT="$OUT" bash scripts/lease/fetch.sh || failed=1
done
[ -n "${tests:-}" ] && { wait "$tests"; cat "${ROOT:-/root}/cuda-tests.out"; }
exit $failed
