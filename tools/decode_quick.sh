#!/usr/bin/env bash
# After a decode kernel change, one device call: the decode/kv_lens/paged GPU tests, time vs
# length at 5 splits, and the API's default on every decode cell against the peers.
#   OUT=dir bash tools/decode_quick.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_kv_lens.py tests/test_paged.py \
    -p no:cacheprovider -rfE -n 2 > "$OUT/decode_tests.log" 2>&1; echo "tests rc=$?"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/decode_tests.log" | tail -12
SPLITS=5 timeout 60 python3 tools/decode_fixed.py 2>&1 | grep -v Warn | tee "$OUT/fixed.log"
timeout 200 python3 tools/decode_probe.py "$OUT/decode_probe.json" --default-only 2>&1 | grep -v Warn | tee "$OUT/decode_probe.log" | grep DECODE
