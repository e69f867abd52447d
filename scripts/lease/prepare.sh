#!/usr/bin/env bash
# Here, before the first call to a lent GPU machine (the `device` tool): put what the machine lacks into .gpu/
# (ignored by git, so it travels only when a call names it in `carry`): the pure-Python gguf wheel, two benchmark
# files, and the target's GGUF in four parts small enough to ride beside the ~41 MB tree (64 MiB a
# call). docs/TRAINING.md "A lent GPU, call by call" gives the calls that follow.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
GGUF=$(PYTHONPATH=src "$PY" -c "from dflash.hub import fetch_gguf; print(fetch_gguf('smollm2-135m'))")
DATA=${DFLASH_DATA_DIR:-../shared/data}
mkdir -p .git/info .gpu/tools
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
"$PY" -m pip download --no-deps --only-binary=:all: -q gguf==0.19.0 -d .gpu/tools
cp "$DATA/gsm8k_test.jsonl" "$DATA/mt_bench.jsonl" .gpu/tools/  # for a CUDA bench: DFLASH_DATA_DIR=/root/data
rm -f .gpu/part0?
head -c 22000000 "$GGUF" > .gpu/part00  # the first part rides with the tools, so it is the smallest
tail -c +22000001 "$GGUF" > .gpu/rest
split -n 3 -d -a 2 --numeric-suffixes=1 .gpu/rest .gpu/part && rm .gpu/rest
cat .gpu/part0? | sha256sum
ls -l .gpu .gpu/tools
