# One call that trains and brings the drafter back (carry the last GGUF part, or call after the call that did):
# launch.sh, then fetch.sh in the SAME call. The machine goes back after 30 s without a call, and a gap that long
# between polls (a slow reply on this side is enough) loses a run and everything it learned: the thirty-fourth
# session lost ~960 steps that way. WINDOW: seconds from now by which the run must have ended (the call's timeout_s
# must be at least WINDOW + 40, and 600 at most); the run sizes itself to it (`dflash train --minutes`); the other
# variables are launch.sh's.
# CPU check at tiny scale: PATH=$PWD/.venv/bin:$PATH DEVICE=cpu DTYPE=float32 ANCHORS=8 ACCUM=1 \
#   WINDOW=40 ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/train.sh
set -uo pipefail
: "${OUT:?OUT (the folder that comes back) is required}"
WINDOW=${WINDOW:-520}
export DEADLINE=$(( $(date +%s) + WINDOW ))
bash scripts/lease/launch.sh || exit $?
GIVEUP=$(( DEADLINE + 25 )) OUT="$OUT" bash scripts/lease/fetch.sh
