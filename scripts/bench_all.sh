#!/usr/bin/env bash
# The benchmark runs behind docs/RESULTS.md (CPU). Usage: bash scripts/bench_all.sh [OUT_DIR]
# Exact mode (float32 target; drafter dtype and kernels chosen by measurement; every greedy output compared with ar)
# on the four datasets. Each drafting method runs adaptive (the default: the controller picks 0..B-1 drafts per round
# from calibrated confidences and measured costs) and `:whole` (every round verifies the whole block, the paper's
# setting), side by side in one process with ar interleaved; on GSM8K and HumanEval both drafters also verify trees
# (`:tree15`: the controller's prefix of a 15-node tree; `:tree15:whole`: all of it). FAST_MODE=1 adds the bf16-target
# run, which only pays on CPUs with AMX or AVX512-BF16.
set -euo pipefail
OUT=${1:-runs/bench}
DF=.venv/bin/dflash
METHODS=ar,hf,ngram,eagle3,eagle3:whole,eagle3:tree15:whole,dflash,dflash:whole,dflash@8,dflash:tree15,dflash:tree15:whole
SHORT=ar,ngram,eagle3,dflash,dflash:whole
TREES=ar,eagle3,eagle3:tree15:whole,dflash,dflash:tree15,dflash:tree15:whole
COMMON=(--max-new-tokens 128)
$DF bench --dataset gsm8k     --limit 10 --methods $METHODS "${COMMON[@]}" --out "$OUT/gsm8k"
$DF bench --dataset humaneval --limit 4  --methods $SHORT "${COMMON[@]}" --out "$OUT/humaneval"
$DF bench --dataset humaneval --limit 8  --methods $TREES "${COMMON[@]}" --out "$OUT/humaneval_trees"
$DF bench --dataset math500   --limit 4  --methods $SHORT "${COMMON[@]}" --out "$OUT/math500"
$DF bench --dataset mt_bench  --limit 4  --methods $SHORT "${COMMON[@]}" --out "$OUT/mt_bench"
# llama.cpp, where the optional extra is installed (pip install -e ".[llamacpp]"): on an F32 copy of the registry's
# GGUF (the float32 target's own weights: same numbers, same arithmetic) and on the registry's Q4_1 file itself.
if .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  $DF bench --dataset gsm8k --limit 10 --methods ar,llamacpp,dflash,eagle3 --llamacpp-gguf f32 "${COMMON[@]}" \
    --out "$OUT/gsm8k_llamacpp_f32"
  $DF bench --dataset gsm8k --limit 10 --methods ar,llamacpp,dflash,eagle3 "${COMMON[@]}" --out "$OUT/gsm8k_llamacpp_q4"
fi
if [ "${FAST_MODE:-0}" = 1 ]; then
  $DF bench --dataset gsm8k --limit 5 --methods ar,hf,eagle3,dflash --dtype bfloat16 --max-new-tokens 128 \
    --out "$OUT/gsm8k_bf16" || true   # exits 1 when bf16 numerics make outputs drift
fi
