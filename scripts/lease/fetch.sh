# The last call: wait for RUN's final drafter until GIVEUP (epoch seconds) while the run lives, else take its newest
# checkpoint, and send it back through $OUT in parts under 16 MiB (join them here with cat), with its config,
# vocabulary and logs.
set -uo pipefail
ROOT=${ROOT:-/root}; RUN=${RUN:-run}
: "${GIVEUP:?GIVEUP (epoch seconds) is required}"
# a run that died (launch.sh kept its process id) has nothing more to wait for: its newest checkpoint, or nothing
running() { [ ! -f "$ROOT/$RUN.pid" ] || kill -0 "$(cat "$ROOT/$RUN.pid")" 2>/dev/null; }
while [ ! -f "$ROOT/$RUN/final/model.safetensors" ] && [ "$(date +%s)" -lt "$GIVEUP" ] && running; do sleep 5; done
running || [ -f "$ROOT/$RUN/final/model.safetensors" ] || echo "the run ended without its final drafter"
src="$ROOT/$RUN/final"
[ -f "$src/model.safetensors" ] || { src=$(ls -d "$ROOT/$RUN"/checkpoints/step-* 2>/dev/null | tail -1); echo "no final drafter yet"; }
[ -n "$src" ] && [ -f "$src/model.safetensors" ] || { echo "no drafter to send: $ROOT/$RUN has no checkpoint"; tail -5 "$ROOT/$RUN.log"; exit 1; }
echo "sending $src"
mkdir -p "$OUT"; split -b 15000000 -d "$src/model.safetensors" "$OUT/$RUN.model.part"
cp "$src/config.json" "$OUT/$RUN.config.json"; cp "$src/draft_vocab.json" "$OUT/$RUN.draft_vocab.json"
cp "$ROOT/$RUN/train_config.json" "$OUT/$RUN.train_config.json"; cp "$ROOT/$RUN/log.jsonl" "$OUT/$RUN.log.jsonl"
tail -c 100000 "$ROOT/$RUN.log" > "$OUT/$RUN.stderr.log"
[ -f "$ROOT/$RUN/profile.txt" ] && cp "$ROOT/$RUN/profile.txt" "$OUT/$RUN.profile.txt"  # the 8th file at most
ls -l "$OUT"; grep eval_tau "$ROOT/$RUN/log.jsonl" | cut -c1-100
grep -a "^\[dflash\]" "$ROOT/$RUN.log" | head -12 | cut -c1-240 || true  # the run's choices (per pass, attention) and pace
