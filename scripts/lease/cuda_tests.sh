# The engine issue's CUDA tests on a lent GPU, verbose, into LOG (whole: a test cut off by LIMIT seconds is the one
# after the last line), then one line of counts. bench.sh runs them before its benches; train.sh (TESTS=1) beside
# its training runs, where the minutes cost the lease nothing (tiny models: the GPU and the 16 cores have room).
# test_devices.py first (it has never run on CUDA), the compiling tests of test_graphs.py last: in the
# thirty-eighth session the three files ran out of 85 s at test_graphs.py's first compile, in the sixty-third inside
# it (93 s). TEST_FILES: other tests (the CPU check runs a few).
set -uo pipefail
: "${LOG:?LOG (the file the tests write) is required}" "${LIMIT:?LIMIT (seconds) is required}"
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD/src} DFLASH_CACHE=${DFLASH_CACHE:-/root/dcache}
read -ra files <<< "${TEST_FILES:-tests/test_devices.py tests/test_trees.py tests/test_graphs.py}"
timeout "$LIMIT" "$PY" -m pytest -v -rf --tb=line -p no:cacheprovider "${files[@]}" 2>&1 | grep -v "^$" > "$LOG"
rc=${PIPESTATUS[0]}
echo "CUDA tests rc=$rc: $(grep -c PASSED "$LOG") passed, $(grep -c "FAILED\|ERROR" "$LOG") failed or errors" \
  "(the whole log in $(basename "$LOG"))"
tail -5 "$LOG"
