#!/usr/bin/env bash
# Programmatic dependent launch on the GPU, in one device call: the PDL mechanism test, the key and
# tail split tests and every decode test (its combine kernel is now a PDL dependent), memcheck of
# a tail split, then the tail split next to cuDNN (tools/split_probe.py --tail) and decode's
# combine with and without PDL (tools/pdl_decode_probe.py).
#   OUT=dir bash tools/pdl_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_gpu_pdl.py tests/test_gpu_hopper_tma.py tests/test_gpu_decode.py \
    tests/test_paged.py tests/test_kv_lens.py -k "pdl or split or decode or paged or kv" -p no:cacheprovider -rfE \
    > "$OUT/pdl_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pdl_tests.log" | tail -14
cat > /tmp/tail_small.py <<'PY'
import cupy as cp, numpy as np, ml_dtypes
from cuflash import _problem, gpu_hopper, schedule
rng = np.random.default_rng(0)
for d in (64, 128):
    q = cp.asarray(rng.standard_normal((2, 3, 500, d)).astype(ml_dtypes.bfloat16))
    k = cp.asarray(rng.standard_normal((2, 1, 900, d)).astype(ml_dtypes.bfloat16))
    v = cp.asarray(rng.standard_normal((2, 1, 900, d)).astype(ml_dtypes.bfloat16))
    p = _problem.validate_forward(q, k, v)
    o = cp.empty_like(q); lse = cp.empty((2, 3, 500), cp.float32)
    t = schedule.HOPPER_FORWARD_TILES[d]
    tiles = -(-500 // t.block_m) * 6
    gpu_hopper.forward(p, q, k, v, o, lse, tile=t, split=(tiles - 5, 3))
    cp.cuda.Device().synchronize()
    print(d, "ok", float(cp.abs(o.astype(cp.float32)).max()))
PY
timeout 120 compute-sanitizer --tool memcheck python3 /tmp/tail_small.py > "$OUT/tail_memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -2 "$OUT/tail_memcheck.log"
timeout 260 python3 tools/split_probe.py "$OUT/tail_probe.json" --tail --forced ${FORCED:-2,3,5} ${TAIL_ARGS:-} > "$OUT/tail_probe.log" 2>&1
echo "tail probe rc=$?"; grep SPLIT "$OUT/tail_probe.log"
timeout 150 python3 tools/pdl_decode_probe.py "$OUT/pdl_decode.json" > "$OUT/pdl_decode.log" 2>&1
echo "decode probe rc=$?"; grep DECODE "$OUT/pdl_decode.log"
