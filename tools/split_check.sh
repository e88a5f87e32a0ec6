#!/usr/bin/env bash
# The forward's key split on the GPU, in one device call: its tests (and every other TMA forward
# and accounting test), memcheck of a small forced split, then tools/split_probe.py next to cuDNN.
#   OUT=dir bash tools/split_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# QUICK=1: only the split's own tests, the accounting and the dispatch check (no racecheck)
if [ -n "${QUICK:-}" ]; then
    timeout 240 python3 -m pytest -q -m gpu -n 4 tests/test_gpu_hopper_tma.py tests/test_gpu_accounting.py \
        tests/test_gpu_forward.py -k "split or bytes or runs_the_wgmma" -p no:cacheprovider -rfE > "$OUT/split_tests.log" 2>&1
else
    timeout 240 python3 -m pytest -q -m gpu -n 4 tests/test_gpu_hopper_tma.py tests/test_gpu_accounting.py \
        tests/test_gpu_forward.py -p no:cacheprovider -rfE > "$OUT/split_tests.log" 2>&1
fi
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/split_tests.log" | tail -12
cat > /tmp/split_small.py <<'PY'
import cupy as cp, numpy as np, ml_dtypes
from cuflash import _problem, gpu_hopper, schedule
rng = np.random.default_rng(0)
for d in (64, 128):
    q = cp.asarray(rng.standard_normal((2, 3, 300, d)).astype(ml_dtypes.bfloat16))
    k = cp.asarray(rng.standard_normal((2, 1, 700, d)).astype(ml_dtypes.bfloat16))
    v = cp.asarray(rng.standard_normal((2, 1, 700, d)).astype(ml_dtypes.bfloat16))
    p = _problem.validate_forward(q, k, v)
    o = cp.empty_like(q); lse = cp.empty((2, 3, 300), cp.float32)
    t = schedule.HOPPER_FORWARD_TILES[d]
    tiles = -(-300 // t.block_m) * 6
    gpu_hopper.forward(p, q, k, v, o, lse, tile=t, split=3)
    cp.cuda.Device().synchronize()
    print(d, "ok", float(cp.abs(o.astype(cp.float32)).max()))
PY
timeout 150 compute-sanitizer --tool memcheck python3 /tmp/split_small.py > "$OUT/split_memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -3 "$OUT/split_memcheck.log"; grep -cE "Invalid|out of bounds" "$OUT/split_memcheck.log"
if [ -z "${QUICK:-}" ]; then
    timeout 150 compute-sanitizer --tool racecheck python3 /tmp/split_small.py > "$OUT/split_racecheck.log" 2>&1
    echo "racecheck rc=$?"; tail -3 "$OUT/split_racecheck.log"
fi
timeout 240 python3 tools/split_probe.py "$OUT/split_probe.json" --forced 3 > "$OUT/split_probe.log" 2>&1
echo "probe rc=$?"; grep SPLIT "$OUT/split_probe.log"
