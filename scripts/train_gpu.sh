#!/usr/bin/env bash
# The whole drafter job on one GPU: regenerate a broad prompt mix with the target, then train the paper-size DFlash
# drafter (5 layers, block 16, 512 anchors per sequence, several epochs), checkpointing every few minutes so a run
# cut short resumes where it stopped: run the same command again. What needs to come back is OUT/train/final (the
# drafter, ~40 MB in bf16 at 5 layers) and the logs (OUT/data/manifest.json, OUT/train/log.jsonl).
#
# Usage: bash scripts/train_gpu.sh TARGET OUT
#   TARGET  a registry name (smollm2-135m), a Hugging Face folder or a .gguf file
#   OUT     the run folder: OUT/data (the regenerated corpus), OUT/corpus (it packed), OUT/train (checkpoints, final)
# Settings (environment): DEVICE (cuda), DTYPE (bfloat16), SAMPLES (3 responses per prompt: greedy-free sampling at
# TEMPERATURE 0.7, so ~19K prompts give ~57K sequences), BATCH (256 sequences decoded together), MAX_NEW (512),
# LAYERS (5), EPOCHS (6), ANCHORS (512), GRAD_ACCUM (8 sequences per step), SAVE_MINUTES (4), PY (python),
# SHAREGPT (17671 conversations), GSM8K (7473 rows), MAX_STEPS (unset: all epochs; set it to stop a chunk early),
# LOSS (kl: self-distillation), INIT (random), KV_HEADS (unset: the target's; e.g. its attention heads for a drafter
# whose context path is as wide as its residual stream, docs/TRAINING.md), NPROC (1; N > 1 runs data and training in
# N processes under torchrun, one GPU each, or several to a GPU when N exceeds the GPUs: the prompts are split
# between them, and GRAD_ACCUM stays the global batch).
# CPU smoke test: DEVICE=cpu DTYPE=float32 with a tiny target (tests).
set -euo pipefail
TARGET=${1:?usage: train_gpu.sh TARGET OUT}
OUT=${2:?usage: train_gpu.sh TARGET OUT}
PY=${PY:-python}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SAMPLES=${SAMPLES:-3}
TEMPERATURE=${TEMPERATURE:-0.7}
BATCH=${BATCH:-256}
MAX_NEW=${MAX_NEW:-512}
SHAREGPT=${SHAREGPT:-17671}
GSM8K=${GSM8K:-7473}
INPUTS=${INPUTS:-"gsm8k_train.jsonl:$GSM8K code_alpaca_2k.jsonl"}
LAYERS=${LAYERS:-5}
EPOCHS=${EPOCHS:-6}
ANCHORS=${ANCHORS:-512}
GRAD_ACCUM=${GRAD_ACCUM:-8}
SAVE_MINUTES=${SAVE_MINUTES:-4}
LOSS=${LOSS:-kl}
INIT=${INIT:-random}
KV_HEADS=${KV_HEADS:-}
NPROC=${NPROC:-1}
mkdir -p "$OUT"
if [ "$NPROC" -gt 1 ]; then
  DFLASH=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m dflash)
else
  DFLASH=("$PY" -m dflash)
fi

input_flags=()
for spec in $INPUTS; do input_flags+=(--input "$spec"); done
sharegpt_flags=()
[ "$SHAREGPT" -gt 0 ] && sharegpt_flags=(--sharegpt "$SHAREGPT")

echo "[train_gpu] $(date -u +%FT%TZ) data -> $OUT/data" >&2
# resumable: a second run skips the rows already regenerated
"${DFLASH[@]}" data --target "$TARGET" --device "$DEVICE" --dtype "$DTYPE" "${input_flags[@]}" \
  "${sharegpt_flags[@]}" --samples "$SAMPLES" --temperature "$TEMPERATURE" --max-new-tokens "$MAX_NEW" \
  --batch-size "$BATCH" --out "$OUT/data"
"$PY" -m dflash data --out "$OUT/data" --pack "$OUT/corpus"

echo "[train_gpu] $(date -u +%FT%TZ) train -> $OUT/train" >&2
train_flags=(--target "$TARGET" --device "$DEVICE" --dtype "$DTYPE" --data "$OUT/corpus" --out "$OUT/train"
  --no-progress --save-minutes "$SAVE_MINUTES" --save-every 100000 --eval-every 500 --log-every 20)
[ -n "${MAX_STEPS:-}" ] && train_flags+=(--max-steps "$MAX_STEPS")
if compgen -G "$OUT/train/checkpoints/step-*" > /dev/null; then
  "${DFLASH[@]}" train "${train_flags[@]}" --resume
else
  [ -n "$KV_HEADS" ] && train_flags+=(--kv-heads "$KV_HEADS")
  "${DFLASH[@]}" train "${train_flags[@]}" --num-layers "$LAYERS" --block-size 16 --anchors-per-seq "$ANCHORS" \
    --epochs "$EPOCHS" --grad-accum "$GRAD_ACCUM" --loss "$LOSS" --init "$INIT"
fi
echo "[train_gpu] $(date -u +%FT%TZ) done: $OUT/train/final" >&2
