#!/usr/bin/env bash
# Branch next/decode-copy-fastpath on the GPU machine, one device call (~7 min): the decode GPU
# tests with the block ring's predicate-free copy (load_tile_rows_full), then an A/B of the copy
# (CUFLASH_DECODE_FULL_COPY=1 / 0, alternating processes, two passes each) over the decode grid and
# the seven MQA shapes, each run next to cuDNN and FA2 in its own process.
#   OUT=dir bash tools/copy_fastpath_check.sh ; then python3 tools/grid_table.py on the JSON files
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -m gpu tests/test_decode_wide_rows.py tests/test_gpu_decode.py tests/test_decode_cluster.py \
    tests/test_kv_lens.py tests/test_paged.py tests/test_gpu_prepared.py tests/test_gpu_graph_capture.py \
    -p no:cacheprovider -rfE -n 8 > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
grep -E "^FAILED|^ERROR" "$OUT/decode_tests.log" | head -20; tail -2 "$OUT/decode_tests.log"
mqa=8x64x1x32768,64x64x1x16384,16x128x1x8192,1x64x1x32768,16x64x1x16384x64,64x48x1x16384x64,64x128x1x16384x64
for p in 1 2; do
    for full in 1 0; do
        CUFLASH_NVRTC_OPTIONS="-DCUFLASH_DECODE_FULL_COPY=$full" timeout 55 python3 benchmarks/peers.py --ops decode \
            --impls cuflash,torch-flash,torch-cudnn --max-seconds 45 --out "$OUT/grid_full${full}_$p.json" \
            > "$OUT/grid_full${full}_$p.log" 2>&1; echo "grid full=$full pass $p rc=$?"
        CUFLASH_NVRTC_OPTIONS="-DCUFLASH_DECODE_FULL_COPY=$full" timeout 40 python3 benchmarks/peers.py --ops decode \
            --impls cuflash,torch-flash,torch-cudnn --max-seconds 30 --seconds-per-impl 0.8 --decode-shapes "$mqa" \
            --out "$OUT/mqa_full${full}_$p.json" > "$OUT/mqa_full${full}_$p.log" 2>&1; echo "mqa full=$full pass $p rc=$?"
    done
done
for full in 1 0; do
    echo "== CUFLASH_DECODE_FULL_COPY=$full"
    python3 tools/grid_table.py "$OUT"/grid_full${full}_*.json "$OUT"/mqa_full${full}_*.json | grep -E "^decode"
done
cd "$OUT" && tar czf ab.tgz grid_full* mqa_full* && rm -f grid_full* mqa_full*
