#!/usr/bin/env bash
# ncu of the kernels behind the cells that fall short of cuDNN (the closing notes' "measured
# reason"), one device call: the warp-specialized backward at d=64 full and d=128 causal (N=4k),
# the forward at d=64 causal and d=256 full (N=1k). fp16, benchmark shapes (tools/prof_one.py).
#   OUT=dir bash tools/ncu_gaps.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
sections="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
run() {  # name kernel-regex d n causal
    timeout 90 ncu --clock-control none -k "regex:$2" -c 1 $sections python3 tools/prof_one.py "$3" "$4" "$5" > "$OUT/ncu_$1.txt" 2>&1
    echo "== $1 rc=$?"
    grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Active Warps|Registers Per|Waves Per SM|Stall|highest-utilized" "$OUT/ncu_$1.txt" | head -16
}
run bwd_ws_d64_n4k_full attn_bwd_kv_wgmma_ws 64 4096 0
run bwd_ws_d128_n4k_causal attn_bwd_kv_wgmma_ws 128 4096 1
run fwd_d64_n1k_causal attn_fwd_wgmma 64 1024 1
run fwd_d256_n1k_full attn_fwd_wgmma 256 1024 0
