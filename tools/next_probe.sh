#!/usr/bin/env bash
# One device call (about 7 minutes) for the open leads after 54c461c:
#   1. the GPU tests that have not run yet (3-warpgroup round-robin ping-pong, test_gpu_hopper_tma.py);
#   2. the d=64 forward sweep next to cuDNN with that variant;
#   3. ncu of the TMA forward at d=128, N=1k (is the prologue/epilogue exposed? tensor-pipe use,
#      stall reasons) and of the TMA backward K/V kernel at d=128, N=4k (where its time goes);
#   (decode: tools/decode_l2_probe.sh, its own call)
#   OUT=dir bash tools/next_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_hopper_tma.py -p no:cacheprovider -rfE -n 2 \
    --junitxml="$OUT/junit_tma.xml" > "$OUT/tma_tests.log" 2>&1; echo "tma tests rc=$?"; tail -2 "$OUT/tma_tests.log"
timeout 100 python3 tools/hopper_fwd_sweep.py --d 64 --json "$OUT/fwd_sweep_d64.json" > "$OUT/fwd_sweep_d64.log" 2>&1
echo "sweep rc=$?"; cat "$OUT/fwd_sweep_d64.log"
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
timeout 100 ncu --clock-control none -k regex:attn_fwd_wgmma_tma --launch-count 1 $SECTIONS \
    python3 tools/prof_one.py 128 1024 0 > "$OUT/ncu_fwd_d128_n1k.txt" 2>&1; echo "ncu fwd rc=$?"
timeout 100 ncu --clock-control none -k regex:attn_bwd_kv_wgmma --launch-count 1 $SECTIONS --section MemoryWorkloadAnalysis \
    python3 tools/prof_one.py 128 4096 0 > "$OUT/ncu_bwd_d128_n4k.txt" 2>&1; echo "ncu bwd rc=$?"
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Stall|Achieved Occupancy" \
    "$OUT/ncu_fwd_d128_n1k.txt" "$OUT/ncu_bwd_d128_n4k.txt" | head -40
