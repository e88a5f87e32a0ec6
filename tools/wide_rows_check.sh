#!/usr/bin/env bash
# Branch next/decode-row-split on the GPU machine, one device call (~4 min): the wide-rows kernel's
# own GPU tests; the decode GPU tests with CUFLASH_DECODE_WIDE_ROWS=1 (the planner then launches it
# for MQA through the API: kv_lens, paged, prepared and captured calls - expect only the tests that
# name the planner's kernel for those shapes to fail); tools/wide_rows_probe.py against the peers.
#   OUT=dir bash tools/wide_rows_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -m gpu tests/test_decode_wide_rows.py -p no:cacheprovider -rfE -n 4 \
    > "$OUT/wide_tests.log" 2>&1; echo "wide tests rc=$?"; tail -3 "$OUT/wide_tests.log"
CUFLASH_DECODE_WIDE_ROWS=1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_decode_cluster.py \
    tests/test_kv_lens.py tests/test_paged.py tests/test_gpu_prepared.py tests/test_gpu_graph_capture.py \
    -p no:cacheprovider -rfE -n 8 > "$OUT/auto_tests.log" 2>&1; echo "auto tests rc=$?"
grep -E "^FAILED|^ERROR" "$OUT/auto_tests.log" | head -30; tail -2 "$OUT/auto_tests.log"
timeout 150 python3 tools/wide_rows_probe.py "$OUT/wide_probe.json" 2 2>&1 | grep -v Warn | tee "$OUT/wide_probe.log"
