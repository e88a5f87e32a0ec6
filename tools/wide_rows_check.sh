#!/usr/bin/env bash
# The wide-rows rule on the GPU machine, one device call (~4 min): the decode GPU tests with the
# planner as it is (gpu_decode.planner_tile: the wide-rows tile for MQA and nq=16 GQA shapes through
# the API - kv_lens, paged, prepared and captured calls), then tools/wide_rows_probe.py against the
# peers (rule / rule off / wide forced).
#   OUT=dir bash tools/wide_rows_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -m gpu tests/test_decode_wide_rows.py tests/test_gpu_decode.py tests/test_decode_cluster.py \
    tests/test_kv_lens.py tests/test_paged.py tests/test_gpu_prepared.py tests/test_gpu_graph_capture.py \
    -p no:cacheprovider -rfE -n 8 > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
grep -E "^FAILED|^ERROR" "$OUT/decode_tests.log" | head -30; tail -2 "$OUT/decode_tests.log"
timeout 200 python3 tools/wide_rows_probe.py "$OUT/wide_probe.json" "${PASSES:-3}" 2>&1 | grep -v Warn | tee "$OUT/wide_probe.log"
