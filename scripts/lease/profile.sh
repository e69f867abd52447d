# A call on a lent GPU (after bench.sh, before a training): where a round's time goes. Runs `dflash bench` on ONE
# prompt under torch.profiler and prints the ops that cost the most host time and the most GPU time (twenty-seventh
# session: this is how cuDNN attention's per-shape planning showed, 1-2 ms of host time per eager call for 4 us of
# GPU work). METHODS (default ar,dflash:whole), FLAGS (default --cuda-graphs), NEW tokens (default 48).
# CPU check at tiny scale: PY=.venv/bin/python DEVICE=cpu DTYPE=float32 TARGET=tiny-llama METHODS=ar,ngram FLAGS= \
#   NEW=8 DFLASH_DATA_DIR=../shared/data ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/profile.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
export DFLASH_DATA_DIR=${DFLASH_DATA_DIR:-/root/data}
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-bfloat16}; TARGET=${TARGET:-smollm2-135m}
METHODS=${METHODS:-ar,dflash:whole}; FLAGS=${FLAGS---cuda-graphs}; NEW=${NEW:-48}; ROOT=${ROOT:-/root}
: "${OUT:?OUT (the folder that comes back) is required}"
mkdir -p "$OUT" "$ROOT"
ROOT="$ROOT" bash scripts/lease/join.sh || exit 3
"$PY" - "$DEVICE" "$DTYPE" "$TARGET" "$METHODS" "$NEW" "$ROOT/profile-bench" $FLAGS <<'PY' 2>&1 | tee "$OUT/profile.txt"
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

device, dtype, target, methods, new, out, *flags = sys.argv[1:]
sys.argv = ["dflash", "bench", "--target", target, "--device", device, "--dtype", dtype, "--dataset", "gsm8k",
            "--limit", "1", "--methods", methods, "--max-new-tokens", new, "--no-progress", "--out", out, *flags]
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
with profile(activities=activities, record_shapes=True) as prof:
    try:
        runpy.run_module("dflash", run_name="__main__")
    except SystemExit:
        pass
table = prof.key_averages(group_by_input_shape=True)
print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40, max_shapes_column_width=70))
if device == "cuda":
    print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=40,
                      max_shapes_column_width=70))
PY
