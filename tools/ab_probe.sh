#!/usr/bin/env bash
# A/B of a backward kernel change in one device call: snapA (before) and snapB (after) each run the
# warp-specialized tests (snapB) and tools/hopper_bwd_sweep.py; then ncu of snapB's warp-specialized
# kernel at d=128, N=4k (NCU=0 skips it; SNAPS / SWEEP_VARIANTS / SWEEP_TIMEOUT below; SAN_BLOCKS: blocks of tiny_bwd's wsp; RACE_D / SAN_D: head dims of the racecheck / synccheck runs; SAN_VARIANT=tma sanitizes the TMA kernel; AB_TESTS picks the tests). Prepare: git archive <before> | tar -x -C snapA, same for snapB.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
cd "$root/snapB" && export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -m gpu ${AB_TESTS:-tests/test_gpu_hopper_bwd_tma.py -k warp_specialized} \
    -p no:cacheprovider -rfE -n 4 > "$OUT/b_tests.log" 2>&1; echo "snapB tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/b_tests.log" | tail -8
# SNAPS: the snapshots swept, in order (e.g. "A B A B" alternates them against drift); SWEEP_VARIANTS
# narrows each sweep to some of hopper_bwd_sweep.py's variants.
i=0
for s in ${SNAPS:-A B}; do
    i=$((i + 1)); cd "$root/snap$s" && export PYTHONPATH=$PWD
    timeout ${SWEEP_TIMEOUT:-150} python3 tools/hopper_bwd_sweep.py --n ${SWEEP_N:-1024,4096,16384} ${SWEEP_VARIANTS:+--variants $SWEEP_VARIANTS} \
        --json "$OUT/sweep_${s}_$i.json" > "$OUT/sweep_${s}_$i.log" 2>&1
    echo "snap$s sweep rc=$?"; cat "$OUT/sweep_${s}_$i.log"
done
cd "$root/snapB" && export PYTHONPATH=$PWD
for sv in ${SAN_VARIANT:-ws}; do  # (a list: each variant of tools/tiny_bwd.py sanitized in turn)
    timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_bwd.py 1 2 300 ${RACE_D:-128} bf16 true $sv ${SAN_BLOCKS:-} > "$OUT/b_racecheck_$sv.log" 2>&1
    echo "racecheck $sv rc=$?"; tail -1 "$OUT/b_racecheck_$sv.log"
    timeout 60 compute-sanitizer --tool synccheck python3 tools/tiny_bwd.py 2 2 333 ${SAN_D:-64} bf16 true $sv ${SAN_BLOCKS:-} > "$OUT/b_synccheck_$sv.log" 2>&1
    echo "synccheck $sv rc=$?"; tail -1 "$OUT/b_synccheck_$sv.log"
done
[ "${NCU:-1}" = 1 ] && timeout 120 ncu --clock-control none -k regex:attn_bwd_kv_wgmma_ws -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    python3 tools/prof_one.py 128 4096 0 > "$OUT/ncu_ws_d128_n4k.txt" 2>&1
echo "ncu rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Registers Per|Warp Cycles Per Issued|Achieved Occupancy|Stall" "$OUT/ncu_ws_d128_n4k.txt" | head -20
