#!/usr/bin/env bash
# One device call for the branch next/session7 (main + next/fwd-lpt + next/bwd-d192, neither run
# through the whole GPU suite yet): the whole suite and the side-by-side benchmark
# (tools/final_check.sh), the backward cells at d=192 (the new dispatch) and a forward trace
# (tools/fwd_trace.py, -DCUFLASH_FWD_TRACE builds of the short cells), all written under
# $OUT/run and packed into $OUT/run.tar.gz; summary.json and tests.log also come back as files of
# their own (a device call returns at most 8 files from $OUT).
#
#   OUT=dir GIT_COMMIT=<sha> bash tools/session7_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
run="$OUT/run"; mkdir -p "$run"
PART=all TEST_TIMEOUT=${TEST_TIMEOUT:-300} TEST_WORKERS=4 BLAS_THREADS=4 FWD_TIMEOUT=${FWD_TIMEOUT:-150} PAGED_TIMEOUT=50 \
    OUT="$run" bash tools/final_check.sh > "$run/final.log" 2>&1
grep -E "rc=|passed|failed" "$run/final.log" | head -20
BWD_QUICK_D=192 timeout 90 python3 tools/bwd_quick.py > "$run/bwd192.log" 2>&1; echo "bwd192 rc=$?"; grep BWD "$run/bwd192.log"
# Where the forward's short and non-causal cells (the ones short of cuDNN) spend their time.
timeout 120 python3 tools/fwd_trace.py "$run/fwd_trace.json" 64,1024,0 64,1024,1 64,2048,1 64,4096,1 128,1024,0 \
    128,4096,0 256,1024,0 256,2048,1 > "$run/fwd_trace.log" 2>&1; echo "fwd_trace rc=$?"; grep -A0 CELL "$run/fwd_trace.log"
cp "$run/summary.json" "$run/tests.log" "$OUT/" 2>/dev/null
tar -czf "$OUT/run.tar.gz" -C "$OUT" run && rm -rf "$run"
