# A call on a lent GPU for the engine issue's GPU figures: the CUDA tests, then `dflash bench` on the GPU, eager and
# with --cuda-graphs, side by side with transformers' generate (`hf`). Run it with the GGUF joined (the call carrying
# the last part joins it, join.sh) and BEFORE a training starts: a bench beside a running training
# would time both badly. BUDGET seconds in all (default 240). Back through $OUT (8 files): the software and the
# tests' summary, each bench's results.md and results.json, and the logs' tails in one file.
# CPU check at tiny scale: PY=.venv/bin/python DEVICE=cpu DTYPE=float32 TARGET=tiny-llama METHODS=ar,ngram LIMIT=1 \
#   NEW=8 DFLASH_DATA_DIR=../shared/data ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/bench.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
export DFLASH_DATA_DIR=${DFLASH_DATA_DIR:-/root/data}
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; TARGET=${TARGET:-smollm2-135m}
METHODS=${METHODS:-ar,hf,dflash,dflash+ngram,dflash:whole,dflash:tree15,dflash:tree63:whole}; LIMIT=${LIMIT:-8}; NEW=${NEW:-128}
BUDGET=${BUDGET:-240}; ROOT=${ROOT:-/root}
: "${OUT:?OUT (the folder that comes back) is required}"
mkdir -p "$OUT" "$ROOT"
end=$(($(date +%s) + BUDGET))
left() { echo $((end - $(date +%s))); }

ROOT="$ROOT" bash scripts/lease/join.sh || exit 3

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  if [ "$DEVICE" = cuda ] && [ "${TESTS:-1}" = 1 ]; then  # the graph tests capture for real only where CUDA is
    # TESTS=0 where train.sh ran them beside its training (TESTS=1 there); TEST_SHARE: their share of BUDGET
    # (1/TEST_SHARE); the whole log opens logs.txt (the sixty-third session's tail of 40 lines lost test_devices.py's)
    LOG="$OUT/logs.txt" LIMIT=$(($(left) / ${TEST_SHARE:-3})) PY="$PY" bash scripts/lease/cuda_tests.sh
  fi
} > "$OUT/env-and-tests.txt" 2>&1
cat "$OUT/env-and-tests.txt"

# progress bars go to the log: a run cut off by its share shows how far it got (the thirty-fourth session's
# bfloat16 graphs showed nothing). graphs first (the figures), float32 graphs (the lossless check: bfloat16 logits tie often enough that passes of
# different widths part at exact ties, docs/RESULTS.md, twenty-seventh session), eager last (the measured
# attention backend); each gets an equal share of what is left
# (RUNS picks some by name: the thirty-fourth session measured eager, and its bfloat16 graphs ran out of their share)
if [ "$DEVICE" = cuda ]; then runs=("graphs bfloat16 --cuda-graphs" "graphs-f32 float32 --cuda-graphs" "eager $DTYPE --no-cuda-graphs"
  "graphs-compiled bfloat16 --cuda-graphs --compile")  # compiled: only where RUNS names it
else runs=("eager $DTYPE --no-cuda-graphs"); fi
RUNS=${RUNS:-graphs graphs-f32 eager}
picked=(); for run in "${runs[@]}"; do [[ " $RUNS " == *" ${run%% *} "* ]] && picked+=("$run"); done; runs=("${picked[@]}")
for i in "${!runs[@]}"; do
  read -r name dtype flags <<< "${runs[$i]}"
  share=$(( $(left) / (${#runs[@]} - i) ))
  [ "$share" -gt 20 ] || { echo "$name: no time left"; continue; }
  timeout "$share" "$PY" -m dflash bench --target "$TARGET" --device "$DEVICE" --dtype "$dtype" --dataset gsm8k \
    --limit "$LIMIT" --methods "$METHODS" --max-new-tokens "$NEW" $flags \
    --out "$ROOT/bench-$name" > "$ROOT/bench-$name.log" 2>&1
  echo "$name: rc=$?"
  { echo "== $name"; tail -c 20000 "$ROOT/bench-$name.log"; } >> "$OUT/logs.txt"  # 8 files at most come back
  for f in results.md results.json; do [ -f "$ROOT/bench-$name/$f" ] && cp "$ROOT/bench-$name/$f" "$OUT/$name.$f"; done
  [ -f "$OUT/$name.results.md" ] && cat "$OUT/$name.results.md"
done
ls -l "$OUT"
