#!/usr/bin/env bash
# Device probe for the wgmma forward: diagnosis, its GPU tests, sanitizers, a quick benchmark.
#   OUT=dir bash tools/hopper_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 60 python3 tools/hopper_diag.py > "$OUT/diag.log" 2>&1; echo "diag rc=$?"; cat "$OUT/diag.log" | tail -40
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_fwd.py 1 2 300 128 bf16 true > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -3 "$OUT/racecheck.log"
timeout 60 compute-sanitizer --tool memcheck python3 tools/tiny_fwd.py 1 2 300 64 fp16 false > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
timeout 100 python3 benchmarks/peers.py --ops fwd --d 64,128 --n 1024,4096,16384 --impls cuflash,torch-flash,torch-cudnn \
    --max-seconds 80 --out "$OUT/fwd_wgmma.json" > "$OUT/fwd_wgmma.log" 2>&1; echo "bench rc=$?"; tail -30 "$OUT/fwd_wgmma.log"
timeout 200 python3 -m pytest -q tests/test_gpu_forward.py -p no:cacheprovider -rfE --maxfail=40 \
    > "$OUT/fwd_tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/fwd_tests.log" | tail -45
