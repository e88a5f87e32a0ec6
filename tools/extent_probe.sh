#!/usr/bin/env bash
# One device call for the per-warpgroup key extent (attn_fwd_wgmma.cu, kWgExtent): the forward
# next to cuDNN, snapA (before; prepare: git archive <before> | tar -x -C snapA) and this tree
# alternated (tools/fwd_ab.sh), the d=192 table tile likewise (tools/hopper_fwd_sweep.py), the
# sanitizers on small launches whose warpgroups stop at different key tiles, then the forward GPU
# tests.
#   OUT=dir [SAN=0] [AB_TESTS=...] bash tools/extent_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
SNAPS=${SNAPS:-A HEAD A HEAD} AB_D=${AB_D:-64,128,256} AB_N=${AB_N:-1024,2048,4096} BENCH_TIMEOUT=${BENCH_TIMEOUT:-70} \
    TEST_TIMEOUT=0 bash tools/fwd_ab.sh | tee "$OUT/ab_summary.txt"
i=0
for s in A HEAD A HEAD; do
    i=$((i + 1)); dir=$root/snap$s; [ "$s" = HEAD ] && dir=$root
    (cd "$dir" && PYTHONPATH=$PWD timeout 60 python3 tools/hopper_fwd_sweep.py --d 192 --n 1024,2048,4096 \
        --tiles 128x96wg2s2PP --json "$OUT/d192_${s}_$i.json" > "$OUT/d192_${s}_$i.log" 2>&1; echo "d192 $s rc=$?")
done
export PYTHONPATH=$root
python3 tools/ab_summary.py AB192 "$OUT/d192_*_*.json" | tee -a "$OUT/ab_summary.txt"
[ "${SAN:-1}" = 0 ] || {
san() {  # tool, tiny_fwd args...
    local tool=$1; shift
    timeout 90 compute-sanitizer --tool "$tool" --report-api-errors no python3 tools/tiny_fwd.py "$@" > "$OUT/san.tmp" 2>&1
    echo "$tool $* rc=$? $(tail -1 "$OUT/san.tmp")" | tee -a "$OUT/sanitizers.log"
}
san racecheck 1 2 1000 64 bf16 true pp
san synccheck 1 2 1000 64 bf16 true pp
san racecheck 1 2 450 256 bf16 true tma
san synccheck 1 2 450 256 bf16 true tma
san memcheck 2 2 515 64 bf16 true pppersist
san racecheck 1 2 300 192 fp16 true pp
rm -f "$OUT/san.tmp"
}
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu ${AB_TESTS:-tests/test_gpu_hopper_tma.py tests/test_gpu_forward.py} \
    -p no:cacheprovider -rfE -n 4 > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -12
mkdir -p "$OUT/raw" && mv "$OUT"/fwd_*_*.json "$OUT"/fwd_*_*.log "$OUT"/d192_* "$OUT/raw/" 2>/dev/null; tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$OUT/raw"
