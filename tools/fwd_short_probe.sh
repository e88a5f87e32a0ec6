#!/usr/bin/env bash
# Device probe for the forward's short cells (N = 1k-4k, where cuDNN leads): the d=64 sweep with a
# 3-warpgroup persistent tile next to the table's, then per-tile traces (start / loop / epilogue)
# of the dispatch's tiles and of the 3-warpgroup persistent one. Logs under $OUT (at most 8 files).
#   OUT=dir bash tools/fwd_short_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 200 python3 tools/hopper_fwd_sweep.py --d 64 --n ${SWEEP_N:-1024,2048,4096} --json "$OUT/fwd_sweep.json" \
    > "$OUT/fwd_sweep.log" 2>&1; echo "sweep rc=$?"; cat "$OUT/fwd_sweep.log"
{ timeout 120 python3 tools/fwd_trace.py "$OUT/fwd_trace.json" 64,1024,0 64,1024,1 128,1024,0 128,4096,0 256,1024,0 256,4096,0
  echo "rc=$?"
  FWD_TRACE_TILE=128,3,2,ppp,1 timeout 60 python3 tools/fwd_trace.py "$OUT/fwd_trace_wg3.json" 64,1024,0 64,2048,0
  echo "rc=$?"; } > "$OUT/fwd_trace.log" 2>&1
grep -E "CELL|phases|rc=" "$OUT/fwd_trace.log"
