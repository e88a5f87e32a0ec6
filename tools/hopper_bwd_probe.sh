#!/usr/bin/env bash
# Device probe for the wgmma backward's TMA variant: its GPU tests, sanitizers, the sweep next to
# cuDNN (JSON).   OUT=dir bash tools/hopper_bwd_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q tests/test_gpu_hopper_bwd_tma.py -p no:cacheprovider -rfE --maxfail=10 \
    > "$OUT/bwd_tma_tests.log" 2>&1; echo "bwd tma tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/bwd_tma_tests.log" | head -30
timeout 90 compute-sanitizer --tool racecheck python3 tools/tiny_bwd.py 1 2 300 128 bf16 true tma > "$OUT/racecheck_bwd_tma.log" 2>&1; echo "racecheck bwd tma rc=$?"; tail -2 "$OUT/racecheck_bwd_tma.log"
timeout 90 compute-sanitizer --tool memcheck --report-api-errors no python3 tools/tiny_bwd.py 2 2 333 64 bf16 true tma > "$OUT/memcheck_bwd_tma.log" 2>&1; echo "memcheck bwd tma rc=$?"; tail -2 "$OUT/memcheck_bwd_tma.log"
timeout "${SWEEP_TIMEOUT:-240}" python3 tools/hopper_bwd_sweep.py ${SWEEP_ARGS:-} --json "$OUT/bwd_sweep.json" > "$OUT/bwd_sweep.log" 2>&1; echo "bwd sweep rc=$?"; cat "$OUT/bwd_sweep.log"
