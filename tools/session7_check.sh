#!/usr/bin/env bash
# One device call for the branch next/session7 (main + next/fwd-lpt + next/bwd-d192, neither run
# through the whole GPU suite yet): the whole suite and the side-by-side benchmark
# (tools/final_check.sh, its 8 files), then the backward cells at d=192 (new kernel) and the
# forward A/B of the causal launch order, packed into $OUT/extra.tar.gz (a call returns 8 files
# at most, so everything else goes into one archive... final_check's 8 go in it too).
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
cp "$run/summary.json" "$run/tests.log" "$OUT/" 2>/dev/null
tar -czf "$OUT/run.tar.gz" -C "$OUT" run && rm -rf "$run"
