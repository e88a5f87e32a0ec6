#!/usr/bin/env bash
# One device call for the twelfth session's forward probes:
#  1. poly_exp2 (a share of the softmax's exponentials on the FMA pipes) at d <= 128, every 8th /
#     4th / 2nd 8-key column tile, A/B next to cuDNN (tools/opts_ab.sh, alternated);
#  2. 3-stage d=64 tiles (table and persistent) next to the 2-stage ones (tools/hopper_fwd_sweep.py);
#  3. the wgmma forward GPU tests with every 2nd tile's exponentials on the polynomial at all head dims.
#   OUT=dir bash tools/poly_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P="-DCUFLASH_FWD_POLY_MAX_D=128,-DCUFLASH_FWD_POLY_EVERY"
VARIANTS=${VARIANTS:-"base= p4=$P=4 p2=$P=2 p8=$P=8 p8=$P=8 p2=$P=2 p4=$P=4 base="} TEST_TIMEOUT=0 \
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-50} AB_SECONDS=${AB_SECONDS:-0.4} bash tools/opts_ab.sh | tee "$OUT/ab_summary.txt"
timeout ${SWEEP_TIMEOUT:-90} python3 tools/hopper_fwd_sweep.py --d 64 --n 1024,2048,4096 \
    --tiles 192x128wg3s2PP,128x128wg2s2PP-persist-wgepi,192x128wg3s3PP,128x128wg2s3PP-persist-wgepi \
    --json "$OUT/stages_sweep.json" > "$OUT/stages_sweep.log" 2>&1; echo "stages sweep rc=$?"; cat "$OUT/stages_sweep.log"
CUFLASH_NVRTC_OPTIONS="-DCUFLASH_FWD_POLY_MAX_D=256 -DCUFLASH_FWD_POLY_EVERY=2" timeout ${TEST_TIMEOUT:-130} \
    python3 -m pytest -q -m gpu tests/test_gpu_hopper_tma.py -p no:cacheprovider -rfE -n 4 > "$OUT/tests_poly.log" 2>&1
echo "poly tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests_poly.log" | tail -12
mkdir -p "$OUT/raw" && mv "$OUT"/ab_*_*.json "$OUT"/ab_*_*.log "$OUT/raw/" 2>/dev/null; tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$OUT/raw"
