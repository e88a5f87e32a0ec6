#!/usr/bin/env bash
# One device call for the two branches compiled but never run (2026-11-30): each one's own GPU
# tests and a sanitizer run, next/decode-window's windowed decode timed against main's (band
# kernel) and its no-window decode benchmark, next/fwd-persistent-d256's d=256 sweep. Prepare:
#   for b in main next/decode-window next/fwd-persistent-d256; do d=snap_${b//\//_}; rm -rf $d; mkdir $d; git archive $b | tar -x -C $d; done
#   OUT=dir bash tools/branches_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
D=$root/snap_next_decode-window F=$root/snap_next_fwd-persistent-d256 M=$root/snap_main
cd "$D" && export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_paged.py tests/test_decode_cluster.py \
    tests/test_kv_lens.py -p no:cacheprovider -rfE -n 4 > "$OUT/decode_window_tests.log" 2>&1
echo "decode-window tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/decode_window_tests.log" | tail -8
timeout 60 compute-sanitizer --tool racecheck python3 -c "
import cupy as cp, cuflash
q = cp.random.standard_normal((2, 8, 3, 128), dtype=cp.float32).astype(cp.float16)
k = cp.random.standard_normal((2, 2, 3000, 128), dtype=cp.float32).astype(cp.float16)
cuflash.attention(q, k, k, causal=True, window=(700, 0)); cp.cuda.Device().synchronize(); print('ok')
" > "$OUT/decode_window_racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -1 "$OUT/decode_window_racecheck.log"
for s in M D; do
    snap=${!s}; cd "$snap" && export PYTHONPATH=$PWD
    timeout 60 python3 "$root/tools/window_decode_bench.py" "$OUT/window_decode_$s.json" > "$OUT/window_decode_$s.log" 2>&1
    echo "window decode ($s) rc=$?"; grep WINDOW "$OUT/window_decode_$s.log"
done
cd "$D" && export PYTHONPATH=$PWD
timeout 60 python3 benchmarks/peers.py --ops decode --impls cuflash,torch-cudnn --max-seconds 45 \
    --out "$OUT/decode_bench_D.json" > "$OUT/decode_bench_D.log" 2>&1; echo "decode bench rc=$?"
cd "$F" && export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_hopper_tma.py -k "persistent" -p no:cacheprovider -rfE -n 4 \
    > "$OUT/fwd256_tests.log" 2>&1; echo "fwd-persistent-d256 tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/fwd256_tests.log" | tail -8
timeout 150 python3 tools/hopper_fwd_sweep.py --d 256 --n 1024,2048,4096 --json "$OUT/fwd256_sweep.json" \
    > "$OUT/fwd256_sweep.log" 2>&1; echo "d=256 sweep rc=$?"; cat "$OUT/fwd256_sweep.log"
