#!/usr/bin/env bash
# Decode small-cell diagnosis: time vs length (flushed and warm) and ncu per-instruction stall
# samples of the decode kernel at (4k, B=8, Hkv=8).   OUT=dir bash tools/decode_diag.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 150 python3 tools/decode_fixed.py 2>&1 | grep -v Warn | tee "$OUT/fixed.log"
timeout 200 ncu --clock-control none -k regex:attn_decode --launch-skip 2 --launch-count 1 --section WarpStateStats \
    --section SourceCounters --section SchedulerStats --section MemoryWorkloadAnalysis_Chart \
    --page details python3 tools/decode_one.py 4096 8 8 > "$OUT/ncu_details.txt" 2>&1; echo "ncu rc=$?"
timeout 200 ncu --clock-control none -k regex:attn_decode --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --page source --print-source sass --csv python3 tools/decode_one.py 4096 8 8 \
    > "$OUT/ncu_source.csv" 2>&1; echo "ncu source rc=$?"; wc -l "$OUT/ncu_source.csv"
grep -E "Stall|Warp Cycles|Issued|Eligible|No Eligible|Active Warps" "$OUT/ncu_details.txt" | head -30
