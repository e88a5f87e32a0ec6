#!/usr/bin/env bash
# Device check of the float32 kernels (attn_fwd_fp32.cu, attn_bwd_fp32.cu): their GPU tests and
# memcheck / racecheck of a small backward. Logs under $OUT.
#   OUT=dir bash tools/fp32_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/test_gpu_backward_fp32.py tests/test_gpu_forward.py -k "f32 or fp32 or float32 or backward_fp32" \
    -p no:cacheprovider -rfE -n "${TEST_WORKERS:-4}" > "$OUT/fp32_tests.log" 2>&1
echo "fp32 tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/fp32_tests.log" | head -30; tail -2 "$OUT/fp32_tests.log"
cat > "$OUT/tiny_bwd32.py" <<'PY'
import sys
import cupy as cp, numpy as np, cuflash
b, h, hkv, nq, nk, d = (int(x) for x in sys.argv[1:7]); causal = sys.argv[7] != "false"
rng = np.random.default_rng(0)
q = cp.asarray(rng.standard_normal((b, h, nq, d)).astype(np.float32))
k, v = (cp.asarray(rng.standard_normal((b, hkv, nk, d)).astype(np.float32)) for _ in range(2))
do = cp.asarray(rng.standard_normal((b, h, nq, d)).astype(np.float32))
o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
g = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
cp.cuda.Device().synchronize(); print("ok", [float(cp.abs(x).max()) for x in g])
PY
for tool in memcheck racecheck; do for c in true false; do
  timeout 120 compute-sanitizer --tool $tool python3 "$OUT/tiny_bwd32.py" 1 4 2 77 101 ${D:-128} $c > "$OUT/san_${tool}_$c.log" 2>&1
  echo "$tool causal=$c rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^ok" "$OUT/san_${tool}_$c.log"
done; done
