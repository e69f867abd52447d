# The launch call (carrying the last GGUF part, or after the call that did; join.sh): join and check the GGUF, then
# start the run in its own session, to end by DEADLINE (epoch seconds): `dflash train --minutes` sizes it to the pace
# it measures, so the schedule anneals inside the lease. INIT is the warm start.
# METHOD=eagle3 trains the shipped EAGLE-3 head instead (RUN=eagle beside a DFlash run: both in one lease, the same
# minutes of the same GPU). NPROC=3 runs 3 training processes on the one GPU (distributed.py: they share it; one
# process left an H100 47% busy). Each DFlash run times its first step at one sequence per pass and at all of a
# step's (the log says which won); SEQS=N fixes it instead (--seqs-per-pass). FLAGS adds training flags to the run,
# e.g. FLAGS="--anchors decoded" (train.sh launches each of its RUNS with FLAGS and its own FLAGS_<name>).
# SAVE_MINUTES: minutes between checkpoints (default 3; the newest is what comes back of a run cut short).
# CPU check at tiny scale: DEVICE=cpu DTYPE=float32 ANCHORS=8 ACCUM=1 ROOT=/tmp/x DEADLINE=$(($(date +%s)+60))
# TARGET, DATA (a packed corpus) and INIT (empty: from scratch) default to SmolLM2, its committed corpus and its
# shipped drafter (tests/test_gpu_script.py runs train.sh through here on a tiny target and corpus).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; ANCHORS=${ANCHORS:-512}; ACCUM=${ACCUM:-8}
LR=${LR:-3e-4}; ROOT=${ROOT:-/root}; RUN=${RUN:-run}; METHOD=${METHOD:-dflash}
INIT=${INIT-src/dflash/drafters/smollm2-135m-$METHOD}  # INIT= (empty): from scratch
# SEED: by default the warm start's seed plus one, so each stage reads the corpus in an order of its own (stages 11 to
# 16 all ran --seed 7: every lease began its epoch, and annealed, on the same sequences); 7 from scratch. The
# held-out split does not depend on the seed (split_heldout), so it stays the same 93 sequences.
init_seed=$([ -n "$INIT" ] && python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('seed', 6))" \
  "$INIT/train_config.json" 2>/dev/null || echo 6)
SEED=${SEED:-$((init_seed + 1))}
TARGET=${TARGET:-smollm2-135m}; DATA=${DATA:-corpus/smollm2-135m}  # a tiny target and corpus: the CPU test
method_flags=(--method "$METHOD")  # anchors are DFlash's own option; the EAGLE-3 head trains on every position
[ "$METHOD" = dflash ] && method_flags+=(--anchors-per-seq "$ANCHORS" ${SEQS:+--seqs-per-pass "$SEQS"})
: "${DEADLINE:?DEADLINE (epoch seconds by which the run must have ended) is required}"
mkdir -p "$ROOT"
ROOT="$ROOT" bash scripts/lease/join.sh || exit 3
NPROC=${NPROC:-1}
if [ "$NPROC" -gt 1 ]; then TRAIN=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m dflash train)
else TRAIN=(python3 -m dflash train); fi
COMMON=(--target "$TARGET" --device "$DEVICE" --dtype "$DTYPE" ${INIT:+--init-from "$INIT"} --data "$DATA"
  "${method_flags[@]}" --eval-fraction 0.006 --epochs 10 --grad-accum "$ACCUM" --lr "$LR" --seed "$SEED"
  --no-progress --keep-checkpoints 2 ${FLAGS:-})
[ "${PROFILE:-1}" = 1 ] && COMMON+=(--profile)  # steps 5-7 through torch.profiler: where a GPU step's time goes
# the run times its own pace over its first steps and fits its warmup and cosine to the minutes left (`dflash train
# --minutes`), so its schedule anneals inside the lease whatever the GPU's pace (until the thirty-ninth session a
# smoke run or a RATE from an earlier lease sized it from here; stage 15 ended ~100 s early that way)
minutes=$(python3 -c "import time; print(round(($DEADLINE - time.time() - 3) / 60, 3))")
echo "launching a run of $minutes minutes (seed $SEED${FLAGS:+, flags: $FLAGS}) into $ROOT/$RUN"
setsid nohup "${TRAIN[@]}" "${COMMON[@]}" --out "$ROOT/$RUN" --minutes "$minutes" \
  --log-every 20 --eval-every 500 --save-every 100000 --save-minutes "${SAVE_MINUTES:-3}" \
  > "$ROOT/$RUN.log" 2>&1 < /dev/null &
echo $! > "$ROOT/$RUN.pid"  # fetch.sh stops waiting when it is gone
