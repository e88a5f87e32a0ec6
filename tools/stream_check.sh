#!/usr/bin/env bash
# One device call: the stream decode kernel's GPU tests (+ the decode tests), then its A B A B
# probe next to cuDNN (tools/decode_stream_probe.py). OUT must be set.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu ${TESTS:-tests/test_gpu_decode_stream.py} -p no:cacheprovider -rfE \
    -n ${TEST_WORKERS:-4} > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -12
timeout ${BENCH_TIMEOUT:-240} python3 tools/decode_stream_probe.py "$OUT/stream_probe.json" --rounds ${ROUNDS:-3} 2>&1 | tee "$OUT/stream_probe.log" | grep -E "STREAM|Error|error" | head -20
