#!/usr/bin/env bash
# Here, before the first call to a lent GPU machine (the `device` tool): put what the machine lacks into .gpu/
# (ignored by git, so it travels only when a call names it in `carry`): the pure-Python gguf wheel, two benchmark
# files, and the target's GGUF in parts sized to ride beside the working tree: a call carries 64 MiB in all, and the
# tree is ~43 MiB whole, ~25 MiB without the EAGLE-3 drafter (LEAN, below), so the parts are sized from the tree as
# it is. Each call carries one part (the first with the tools) and runs join.sh, which joins the GGUF once every part
# is there.
# LEAN=1 (the default) first deletes the EAGLE-3 drafter (19 MB) from the working tree: a lease's training and bench
# use only the DFlash drafter, and without it the GGUF rides in 3 parts instead of 5, two calls fewer, each a gap in
# which the machine can go back (the forty-fourth session lost two fresh machines that way). Afterwards:
# `git checkout -- src/dflash/drafters/smollm2-135m-eagle3` brings it back, byte for byte.
# docs/TRAINING.md "A lent GPU, call by call" gives the calls that follow.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
GGUF=$(PYTHONPATH=src "$PY" -c "from dflash.hub import fetch_gguf; print(fetch_gguf('smollm2-135m'))")
DATA=${DFLASH_DATA_DIR:-../shared/data}
mkdir -p .git/info .gpu/tools
EAGLE=src/dflash/drafters/smollm2-135m-eagle3
[ "${LEAN:-1}" = 1 ] && rm -rf "$EAGLE"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
"$PY" -m pip download --no-deps --only-binary=:all: -q gguf==0.19.0 -d .gpu/tools
cp "$DATA/gsm8k_test.jsonl" "$DATA/mt_bench.jsonl" .gpu/tools/  # for a CUDA bench: DFLASH_DATA_DIR=/root/data
# what every call carries anyway: the tracked files and the untracked ones git does not ignore
# (a tracked file deleted in the tree counts nothing: stat's failure for it must not stop the script)
tree=$({ git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true; } \
  | awk '{s += $1} END {print s}')
tools=$(du -sb .gpu/tools | cut -f1)
room=$((64 * 1048576 - tree - 1048576))  # a MiB to spare for files written before the call
[ "$room" -gt $((4 * 1048576)) ] || { echo "the tree ($tree bytes) leaves no room for model parts"; exit 1; }
rm -f .gpu/part??
head -c $((room - tools)) "$GGUF" > .gpu/part00  # the first part rides with the tools
tail -c +$((room - tools + 1)) "$GGUF" | split -b "$room" -d -a 2 --numeric-suffixes=1 - .gpu/part
cat .gpu/part?? | sha256sum
echo "tree $tree bytes; $(ls .gpu/part?? | wc -l) parts of at most $room bytes (part00 with the tools)"
ls -l .gpu .gpu/tools
[ -d "$EAGLE" ] || echo "after the lease: git checkout -- $EAGLE"
