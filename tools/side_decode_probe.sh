#!/usr/bin/env bash
# One device call: ncu of the backward's side kernels next to its main kernel (d=64 and d=128,
# N=4k, full), ncu of the small decode cell's kernel (stalls, memory), and decode tile candidates
# on the split cells (DECODE_CANDS / DECODE_WAVES as tools/decode_probe.py takes them).
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -n "${TESTS:-}" ]; then  # GPU tests first (e.g. TESTS="tests/test_gpu_decode.py -k ...")
    timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider -rfE -n ${TEST_WORKERS:-4} > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -8
fi
for d in ${BWD_D-64 128}; do
    timeout 150 ncu --clock-control none -k regex:"attn_bwd_prep|attn_bwd_dq_convert|attn_bwd_kv" --section SpeedOfLight \
        python3 tools/prof_one.py $d 4096 0 > "$OUT/ncu_bwd_side_d$d.txt" 2>&1
    echo "ncu bwd d=$d rc=$?"; grep -E "^  attn_bwd|Duration|DRAM Throughput" "$OUT/ncu_bwd_side_d$d.txt" | head -12
done
if [ "${DECODE_NCU:-1}" = 1 ]; then
    timeout 120 ncu --clock-control none -k regex:attn_decode -c 1 --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SourceCounters \
        python3 tools/decode_one.py 4096 8 8 > "$OUT/ncu_decode_small.txt" 2>&1
    echo "ncu decode rc=$?"; grep -E "Duration|DRAM Throughput|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Shared Memory Config" "$OUT/ncu_decode_small.txt" | head -30
fi
if [ -n "${DECODE_CANDS:-}" ]; then
    timeout ${DECODE_TIMEOUT:-200} python3 tools/decode_probe.py "$OUT/decode_split.json" --split-cells > "$OUT/decode_split.log" 2>&1
    echo "decode probe rc=$?"; grep -E "^DECODE|Error|error" "$OUT/decode_split.log" | head -20
fi
if [ -n "${MANY_CANDS:-}" ]; then  # the cells with a block per SM or more
    DECODE_CANDS="$MANY_CANDS" DECODE_WAVES=1 timeout ${DECODE_TIMEOUT:-200} python3 tools/decode_probe.py "$OUT/decode_many.json" --many-cells > "$OUT/decode_many.log" 2>&1
    echo "decode many rc=$?"; grep -E "^DECODE|Error|error" "$OUT/decode_many.log" | head -20
fi
if [ "${BWD_QUICK:-0}" = 1 ]; then
    timeout 200 python3 tools/bwd_quick.py > "$OUT/bwd_quick.log" 2>&1; echo "bwd_quick rc=$?"; tail -8 "$OUT/bwd_quick.log"
fi
