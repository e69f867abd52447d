#!/usr/bin/env bash
# The benchmark runs behind docs/RESULTS.md (CPU). Usage: bash scripts/bench_all.sh [OUT_DIR]
# Exact mode (float32 target, bf16 drafters, every greedy output compared with ar) on the four datasets, each method
# at the paper's setting (DFlash block 16, EAGLE-3 chain depth 7) and at the CPU setting (smaller blocks / chains:
# eagle3@4 = a chain of 3,
# DFlash blocks trimmed by the drafter's confidence), side by side in one process; then the fast mode (bf16 target).
set -euo pipefail
OUT=${1:-runs/bench}
DF=.venv/bin/dflash
METHODS=ar,hf,ngram,eagle3,eagle3@4,dflash@16:0,dflash@8:0,dflash@4:0,dflash,dflash@8
SHORT=ar,ngram,eagle3,eagle3@4,dflash@16:0,dflash,dflash@8
COMMON=(--draft-dtype bfloat16 --max-new-tokens 128)
$DF bench --dataset gsm8k     --limit 10 --methods $METHODS "${COMMON[@]}" --out "$OUT/gsm8k"
$DF bench --dataset humaneval --limit 3  --methods $SHORT "${COMMON[@]}" --out "$OUT/humaneval"
$DF bench --dataset math500   --limit 3  --methods $SHORT "${COMMON[@]}" --out "$OUT/math500"
$DF bench --dataset mt_bench  --limit 2  --methods $SHORT "${COMMON[@]}" --out "$OUT/mt_bench"
$DF bench --dataset gsm8k --limit 5 --methods ar,hf,ngram,eagle3,eagle3@4,dflash@16:0,dflash,dflash@8 --dtype bfloat16 \
  --max-new-tokens 128 --out "$OUT/gsm8k_bf16" || true   # exits 1 when bf16 numerics make outputs drift
