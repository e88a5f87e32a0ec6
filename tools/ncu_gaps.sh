#!/usr/bin/env bash
# ncu of the kernels behind the cells that fall short of cuDNN (the closing notes' "measured
# reason"), one device call, fp16, benchmark shapes (tools/prof_one.py):
#   OUT=dir bash tools/ncu_gaps.sh            sections (speed of light, warp states, occupancy, ...)
#       of the warp-specialized backward at d=64 full and d=128 causal (N=4k), the forward at d=64
#       causal and d=256 full (N=1k);
#   OUT=dir STALLS=1 bash tools/ncu_gaps.sh   why warps do not issue: per-reason stall averages
#       (warps stalled per issued instruction, all warps: a warp-specialized kernel's producer
#       warps add their waits), issue and exp2-pipe activity, of the forward at d=64 and d=256
#       (N=1k) and d=128 (N=4k), all non-causal.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ "${STALLS:-0}" = 1 ]; then
    what=(--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,gpu__time_duration.sum")
    show() {
        grep -E "stalled|gmma|issue_active|pipe_xu|duration" "$1" | awk '$NF+0 >= 0.05 || /gmma|issue|xu|duration/' \
            | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
    }
else
    what=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis)
    show() {
        grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Active Warps|Registers Per|Waves Per SM|Stall|highest-utilized" "$1" | head -16
    }
fi
run() {  # name kernel-regex d n causal
    timeout 100 ncu --clock-control none -k "regex:$2" -c 1 "${what[@]}" python3 tools/prof_one.py "$3" "$4" "$5" > "$OUT/ncu_$1.txt" 2>&1
    echo "== $1 rc=$?"
    show "$OUT/ncu_$1.txt"
}
if [ "${STALLS:-0}" = 1 ]; then
    run fwd_d64_n1k_full attn_fwd_wgmma 64 1024 0
    run fwd_d128_n4k_full attn_fwd_wgmma 128 4096 0
    run fwd_d256_n1k_full attn_fwd_wgmma 256 1024 0
else
    run bwd_ws_d64_n4k_full attn_bwd_kv_wgmma_ws 64 4096 0
    run bwd_ws_d128_n4k_causal attn_bwd_kv_wgmma_ws 128 4096 1
    run fwd_d64_n1k_causal attn_fwd_wgmma 64 1024 1
    run fwd_d256_n1k_full attn_fwd_wgmma 256 1024 0
fi
