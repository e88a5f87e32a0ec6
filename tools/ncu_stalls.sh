#!/usr/bin/env bash
# Why a kernel's warps are not issuing: ncu's per-reason stall averages (warps stalled per issued
# instruction, all warps of the kernel: a warp-specialized kernel's producer warps add their
# waits), tensor pipe and issue activity, for the forward cells short of cuDNN. One device call.
#   OUT=dir bash tools/ncu_stalls.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
metrics="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
run() {  # name kernel-regex d n causal
    timeout 100 ncu --clock-control none -k "regex:$2" -c 1 --metrics "$metrics" python3 tools/prof_one.py "$3" "$4" "$5" > "$OUT/ncu_$1.txt" 2>&1
    echo "== $1 rc=$?"
    grep -E "stalled|gmma|issue_active|pipe_xu|duration" "$OUT/ncu_$1.txt" | awk '$NF+0 >= 0.05 || /gmma|issue|xu|duration/' | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
}
run fwd_d64_n1k_full attn_fwd_wgmma 64 1024 0
run fwd_d128_n4k_full attn_fwd_wgmma 128 4096 0
run fwd_d256_n1k_full attn_fwd_wgmma 256 1024 0
