#!/usr/bin/env bash
# Device check of the float32 kernels (attn_fwd_fp32.cu, attn_bwd_fp32.cu, attn_fp32_mma.cu): their GPU tests and
# memcheck / racecheck of a small backward. Logs under $OUT.
#   OUT=dir bash tools/fp32_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/test_gpu_backward_fp32.py tests/test_gpu_forward.py -k "f32 or fp32 or float32 or backward_fp32" \
    -p no:cacheprovider -rfE -n "${TEST_WORKERS:-4}" > "$OUT/fp32_tests.log" 2>&1
echo "fp32 tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/fp32_tests.log" | head -30; tail -2 "$OUT/fp32_tests.log"
for tool in memcheck racecheck; do for c in true false; do
  timeout 120 compute-sanitizer --tool $tool python3 tools/tiny_bwd.py 1 4 101 ${D:-128} fp32 $c > "$OUT/san_${tool}_$c.log" 2>&1
  echo "$tool causal=$c rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^ok" "$OUT/san_${tool}_$c.log"
done; done
