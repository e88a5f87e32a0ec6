#!/usr/bin/env bash
# Why the non-causal d=128 forward ran 1-4% slower with its warpgroup index read from lane 0
# (warp_uniform; 53 fewer instructions per step): ncu stall reasons, pipe and issue activity
# (tools/ncu_gaps.sh STALLS=1 metrics) and the SpeedOfLight / WarpState sections of the table
# kernel at N=4k and the persistent one at N=1k, as built (per-thread index) and with
# -DCUFLASH_FWD_UNIFORM_ALL=1, fp16 benchmark shapes (tools/prof_one.py).
#   OUT=dir bash tools/uniform_ncu.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
stalls=(--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,smsp__inst_executed.sum")
for variant in base uniform; do
    opts=""; [ "$variant" = uniform ] && opts="-DCUFLASH_FWD_UNIFORM_ALL=1"
    for cell in "4096" "1024"; do
        CUFLASH_NVRTC_OPTIONS="$opts" timeout 100 ncu --clock-control none -k "regex:attn_fwd_wgmma" -c 1 "${stalls[@]}" \
            python3 tools/prof_one.py 128 "$cell" 0 > "$OUT/ncu_${variant}_n${cell}.txt" 2>&1
        echo "== $variant N=$cell rc=$?"
        grep -E "stalled|gmma|issue_active|pipe_xu|duration|inst_executed.sum" "$OUT/ncu_${variant}_n${cell}.txt" \
            | awk '$NF+0 >= 0.05 || /gmma|issue|xu|duration|inst_executed/' \
            | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
    done
done
