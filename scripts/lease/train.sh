# One call that trains and brings the drafter back (carry the last GGUF part, or call after the call that did):
# launch.sh, then fetch.sh in the SAME call. The machine goes back after 30 s without a call, and a gap that long
# between polls (a slow reply on this side is enough) loses a run and everything it learned: the thirty-fourth
# session lost ~960 steps that way. WINDOW: seconds from now by which the run must have ended (the call's timeout_s
# must be at least WINDOW + 40, and 600 at most); the other variables are launch.sh's (RATE=5.5 for the paper's recipe
# on an H100: no timing run).
# CPU check at tiny scale: PATH=$PWD/.venv/bin:$PATH DEVICE=cpu DTYPE=float32 ANCHORS=8 ACCUM=1 RATE=0.5 LOAD_S=10 \
#   WINDOW=60 ROOT=/tmp/x OUT=/tmp/out bash scripts/lease/train.sh
set -uo pipefail
: "${OUT:?OUT (the folder that comes back) is required}"
WINDOW=${WINDOW:-520}
export DEADLINE=$(( $(date +%s) + WINDOW ))
# RATE (steps/s, which sizes the run to the window) by the GPU where unset: the paper's recipe made 5.2-6.1 on an
# H100 (twenty-seventh and thirty-fourth sessions) and 6.9 on an H200 (thirty-eighth, which at RATE=5.5 ended
# ~100 s inside its window); anything else times a smoke run first (launch.sh)
if [ -z "${RATE:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in *H200*) RATE=6.5 ;; *H100*) RATE=5.5 ;; esac
fi
export RATE=${RATE:-}
bash scripts/lease/launch.sh || exit $?
GIVEUP=$(( DEADLINE + 25 )) OUT="$OUT" bash scripts/lease/fetch.sh
