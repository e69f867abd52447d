#!/bin/bash
# One `dflash generate --json` command from an old commit and from the working tree, alternating, RUNS times each:
#   bash scripts/ab_generate.sh OLD_REV RUNS [generate arguments...]
# e.g. make run's command:  bash scripts/ab_generate.sh 85dffaf 3 --compare-ar --max-new-tokens 128 "$PROMPT"
# Prints per run: tokens/s, TTFT ms, TPOT ms, tau (and with --compare-ar: ar tokens/s and the speedup), and a
# hash of the tokens, which must match between the sides wherever the output is deterministic.
# The old commit is checked out as a worktree in /tmp/dflash-ab-REV (removed at the end); both run on this venv.
set -euo pipefail
OLD=$1 RUNS=$2
shift 2
HERE=$(cd "$(dirname "$0")/.." && pwd)
TREE=/tmp/dflash-ab-$OLD
git -C "$HERE" worktree add -q --detach "$TREE" "$OLD"
trap 'git -C "$HERE" worktree remove --force "$TREE"' EXIT
for run in $(seq "$RUNS"); do
  for side in old new; do
    SRC=$HERE/src
    [ "$side" = old ] && SRC=$TREE/src
    PYTHONPATH=$SRC "$HERE/.venv/bin/python" -m dflash generate --json "$@" 2>/dev/null | "$HERE/.venv/bin/python" -c "
import json, sys
d = json.load(sys.stdin)
extra = f\" ar {d['ar_tokens_per_s']:.1f} tok/s, {d['speedup']:.2f}x\" if 'speedup' in d else ''
print(f\"$side: {d['tokens_per_s']:.1f} tok/s, TTFT {d['ttft_ms']:.0f} ms, TPOT {d['tpot_ms']:.1f} ms, tau {d['tau']:.2f}{extra}, tokens #{hash(tuple(d['tokens'])) & 0xffff:04x}\")"
  done
done
