# The last call: wait for RUN's final drafter until GIVEUP (epoch seconds) while the run lives, else take its newest
# checkpoint, and send it back through $OUT as one tar in parts under 16 MiB: the drafter folder (model, config,
# vocabulary) with the run's train_config.json, log.jsonl, the stderr log's tail and profile.txt. Two parts a run
# (the 17 MB drafter), so $OUT's 8 files hold up to four runs (train.sh's RUNS). Here:
#   mkdir -p DIR && cat OUT/RUN.tar.part* | tar -x -C DIR
set -uo pipefail
ROOT=${ROOT:-/root}; RUN=${RUN:-run}
: "${GIVEUP:?GIVEUP (epoch seconds) is required}"
# a run that died (launch.sh kept its process id) has nothing more to wait for: its newest checkpoint, or nothing
running() { [ ! -f "$ROOT/$RUN.pid" ] || kill -0 "$(cat "$ROOT/$RUN.pid")" 2>/dev/null; }
while [ ! -f "$ROOT/$RUN/final/model.safetensors" ] && [ "$(date +%s)" -lt "$GIVEUP" ] && running; do sleep 5; done
running || [ -f "$ROOT/$RUN/final/model.safetensors" ] || echo "$RUN: the run ended without its final drafter"
src="$ROOT/$RUN/final"
[ -f "$src/model.safetensors" ] || { src=$(ls -d "$ROOT/$RUN"/checkpoints/step-* 2>/dev/null | tail -1); echo "$RUN: no final drafter yet"; }
[ -n "$src" ] && [ -f "$src/model.safetensors" ] || { echo "$RUN: no drafter to send: $ROOT/$RUN has no checkpoint"; tail -5 "$ROOT/$RUN.log"; exit 1; }
echo "$RUN: sending $src"
pack="$ROOT/$RUN.pack"; rm -rf "$pack"; mkdir -p "$pack" "$OUT"
cp "$src/model.safetensors" "$src/config.json" "$src/draft_vocab.json" "$pack/"
cp "$ROOT/$RUN/train_config.json" "$ROOT/$RUN/log.jsonl" "$pack/"
tail -c 100000 "$ROOT/$RUN.log" > "$pack/stderr.log"
[ -f "$ROOT/$RUN/profile.txt" ] && cp "$ROOT/$RUN/profile.txt" "$pack/"
tar -C "$pack" -cf - . | split -b 15000000 -d - "$OUT/$RUN.tar.part"
ls -l "$OUT"/"$RUN".tar.part*; grep eval_tau "$ROOT/$RUN/log.jsonl" | cut -c1-100
grep -a "^\[dflash\]" "$ROOT/$RUN.log" | head -12 | cut -c1-240 || true  # the run's choices (per pass, attention) and pace
