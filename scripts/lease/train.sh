# The training call (carry the last GGUF part, or call after the call that did): launch.sh for each run, then
# collect.sh, which waits for the runs and sends them back, in the SAME call, or (CALL) the next one.
# The machine goes back after 30 s without a call, and a gap that long between polls (a slow reply on this side is
# enough) loses a run and everything it learned: the thirty-fourth session lost ~960 steps that way.
# WINDOW: seconds from now by which the runs must have ended; each run sizes itself to it (`dflash train --minutes`).
# CALL: seconds this call may take (default WINDOW + 25: it waits for the runs; its timeout_s must then be at least
# WINDOW + 40, and 600 at most). With a shorter CALL the runs outlast the call, so a window can be longer than a
# call: near CALL's end it sends each run's newest checkpoint back (insurance: should the next call come too late,
# those are what is left), then `OUT=$OUT bash scripts/lease/collect.sh` must be the very next call (timeout_s: the
# rest of the window plus 40). The other variables are launch.sh's.
# RUNS: the runs' names, side by side on the one GPU (default: one, `run`); FLAGS_<name> adds flags to that run only,
# NPROC_<name> gives it that many processes (one drafter, data-parallel over gloo: launch.sh's NPROC); should their
# world end before its first step, the run is launched again as one process (FALLBACK=0: not).
# An A/B at equal GPU time: RUNS="ce kl" FLAGS_kl="--loss kl" (both from the same warm start, seed and corpus order).
# One drafter on two processes beside a lone one: RUNS="a b" NPROC_b=2 FLAGS_b="--grad-accum 16" (b: twice a's batch,
# each of its processes the step's 8 sequences a lone run takes).
# Each comes back as $OUT/<name>.tar.partNN (fetch.sh), two files a run: four runs at most (three with TESTS=1; a
# checkpoint, float32, takes three: two runs at most with a short CALL).
# TESTS=1: the CUDA tests (cuda_tests.sh) beside the runs, started first so that each run's pace is timed with them
# there (a run that slows down after its pace was timed stops short of its annealed end); their log comes back with
# the runs as $OUT/cuda-tests.txt, and the bench call after can leave them out (bench.sh's TESTS=0).
# CPU check at tiny scale: PATH=$PWD/.venv/bin:$PATH DEVICE=cpu DTYPE=float32 ANCHORS=8 ACCUM=1 \
#   WINDOW=40 ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/train.sh
set -uo pipefail
: "${OUT:?OUT (the folder that comes back) is required}"
WINDOW=${WINDOW:-520}; RUNS=${RUNS:-run}; runs=$(echo $RUNS | wc -w); CALL=${CALL:-$((WINDOW + 25))}
ROOT=${ROOT:-/root}; export ROOT
started=$(date +%s)
most=$(( ${TESTS:-0} == 1 ? 3 : 4 )); [ "$CALL" -lt $((WINDOW + 25)) ] && most=2
[ "$runs" -le "$most" ] || { echo "RUNS: $most runs at most here (\$OUT brings back 8 files)"; exit 2; }
export DEADLINE=$(( started + WINDOW ))
processes=0
for run in $RUNS; do  # every name checked before any run starts
  [[ "$run" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { echo "RUNS: '$run' is not a name (letters, digits, _)"; exit 2; }
  nproc_of="NPROC_$run"; n=${!nproc_of:-${NPROC:-1}}
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "$nproc_of: '$n' is not a number of processes"; exit 2; }
  processes=$(( processes + n ))
done
# side by side, each process's torch takes its share of the cores: a process's idle threads spin for a while after
# each parallel operation, and on cores the other run's host work needs (both steps are partly bound by their host)
share=$(( $(nproc) / processes > 0 ? $(nproc) / processes : 1 ))
[ "$processes" -gt 1 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}
mkdir -p "$OUT" "$ROOT"
echo "$DEADLINE" > "$ROOT/deadline"; echo "$RUNS" > "$ROOT/runs"; rm -f "$ROOT/cuda-tests.pid"
if [ "${TESTS:-0}" = 1 ]; then  # in a session of its own: it may outlive this call
  LOG="$ROOT/cuda-tests.txt" LIMIT=$(( WINDOW - 20 )) OMP_NUM_THREADS=2 TORCHINDUCTOR_COMPILE_THREADS=4 \
    setsid nohup bash scripts/lease/cuda_tests.sh > "$ROOT/cuda-tests.out" 2>&1 < /dev/null &
  echo $! > "$ROOT/cuda-tests.pid"
fi
for run in $RUNS; do
  extra="FLAGS_$run"; nproc_of="NPROC_$run"
  RUN=$run NPROC=${!nproc_of:-${NPROC:-1}} FLAGS="$(echo ${FLAGS:-} ${!extra:-})" bash scripts/lease/launch.sh ||
    exit $?
done
# a run on several processes whose world ends before its first step (a shared-GPU world has not run on a GPU yet)
# is launched again as one process (FALLBACK=0: not), so that the lease still trains it
started_training() { [ -s "$ROOT/$1/log.jsonl" ]; }  # its first record: 20 steps, each summed over the world
running() { kill -0 "$(cat "$ROOT/$1.pid")" 2>/dev/null; }
watch_until=$(( started + (CALL - 30 < 240 ? CALL - 30 : 240) ))  # within this call, leaving it time to go on
for run in $RUNS; do
  nproc_of="NPROC_$run"; extra="FLAGS_$run"
  [ "${FALLBACK:-1}" = 1 ] && [ "${!nproc_of:-${NPROC:-1}}" -gt 1 ] || continue
  while ! started_training "$run" && running "$run" && [ "$(date +%s)" -lt "$watch_until" ]; do sleep 3; done
  started_training "$run" || running "$run" && continue
  echo "$run: its world ended before its first step; launching it again as one process. Its log's tail:"
  tail -5 "$ROOT/$run.log"; mv "$ROOT/$run.log" "$ROOT/$run.world.log"
  RUN=$run NPROC=1 FLAGS="$(echo ${FLAGS:-} ${!extra:-})" bash scripts/lease/launch.sh || exit $?
done
[ "$CALL" -ge $((WINDOW + 25)) ] && exec bash scripts/lease/collect.sh
alive() { for run in $RUNS; do running "$run" && return 0; done; return 1; }
while [ "$(date +%s)" -lt $((started + CALL - 20)) ] && alive; do sleep 5; done
for run in $RUNS; do  # the insurance: each run's newest checkpoint (or its final drafter, if it has ended)
  RUN=$run GIVEUP=0 OUT="$OUT" bash scripts/lease/fetch.sh || true
done
echo "the runs train until $(date -u -d "@$DEADLINE" +%T) UTC; the very next call: OUT=\$OUT bash" \
  "scripts/lease/collect.sh (timeout_s $(( DEADLINE - $(date +%s) + 40 )) or more)"
