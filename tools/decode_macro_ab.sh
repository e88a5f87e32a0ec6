#!/usr/bin/env bash
# A/B of one decode switch (a compile-time macro or an environment variable) in one device call: the
# decode GPU tests, then the benchmark with the switch at 1 and at 0 in alternating processes (PASSES each)
# over the MQA shapes (and the issue's decode grid unless GRID=0), each next to cuDNN and FA2 in
# its own process; grid_table prints each setting's ratios. TESTS=0 skips the tests.
#   MACRO=CUFLASH_DECODE_PUBLISH_SWIZZLE OUT=dir bash tools/decode_macro_ab.sh
# SWITCH=<environment variable> instead of MACRO: the A/B sets that variable to 1 / 0 (e.g.
# SWITCH=CUFLASH_DECODE_WIDE_LONG, the planner's ring-4 wide blocks), and the tests run with it at 1.
# (first used for CUFLASH_DECODE_FULL_COPY, the block ring's predicate-free copy)
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
[ -n "${MACRO:-}${SWITCH:-}" ] || { echo "set MACRO or SWITCH"; exit 2; }
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# the environment of one side: run_with <0|1> command...
run_with() {
    local v=$1; shift
    if [ -n "${SWITCH:-}" ]; then env "$SWITCH=$v" "$@"; else CUFLASH_NVRTC_OPTIONS="-D$MACRO=$v" "$@"; fi
}
NAME=${MACRO:-${SWITCH:-}}
if [ "${TESTS:-1}" != 0 ]; then
    ${SWITCH:+env $SWITCH=1} timeout 230 python3 -m pytest -q -m gpu tests/test_decode_wide_rows.py tests/test_gpu_decode.py tests/test_decode_cluster.py \
        tests/test_kv_lens.py tests/test_paged.py tests/test_gpu_prepared.py tests/test_gpu_graph_capture.py \
        -p no:cacheprovider -rfE -n 8 > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
    grep -E "^FAILED|^ERROR" "$OUT/decode_tests.log" | head -20; tail -2 "$OUT/decode_tests.log"
fi
mqa=${MQA_SHAPES:-8x64x1x32768,64x64x1x16384,16x128x1x8192,1x64x1x32768,16x64x1x16384x64,64x48x1x16384x64,64x128x1x16384x64}
for p in $(seq 1 "${PASSES:-2}"); do
    for v in 1 0; do
        if [ "${GRID:-1}" != 0 ]; then
            run_with "$v" timeout 55 python3 benchmarks/peers.py --ops decode \
                --impls cuflash,torch-flash,torch-cudnn --max-seconds 45 --out "$OUT/grid_v${v}_$p.json" \
                > "$OUT/grid_v${v}_$p.log" 2>&1; echo "grid $NAME=$v pass $p rc=$?"
        fi
        run_with "$v" timeout 40 python3 benchmarks/peers.py --ops decode \
            --impls cuflash,torch-flash,torch-cudnn --max-seconds 30 --seconds-per-impl 0.8 --decode-shapes "$mqa" \
            --out "$OUT/mqa_v${v}_$p.json" > "$OUT/mqa_v${v}_$p.log" 2>&1; echo "mqa $NAME=$v pass $p rc=$?"
    done
done
for v in 1 0; do
    echo "== $NAME=$v"
    python3 tools/grid_table.py "$OUT"/*_v${v}_*.json | grep -E "^decode"
done
cd "$OUT" && tar czf ab.tgz grid_v* mqa_v* 2>/dev/null; rm -f grid_v* mqa_v*
