#!/usr/bin/env bash
# Device probe for the wgmma forward: the TMA-fed kernel's GPU tests, sanitizers on it, the tile
# sweep next to cuDNN (JSON), then the forward GPU tests.   OUT=dir [SWEEP_ARGS=...] bash tools/hopper_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q tests/test_gpu_hopper_tma.py -p no:cacheprovider -rfE --maxfail=20 -x \
    > "$OUT/tma_tests.log" 2>&1; echo "tma tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/tma_tests.log" | head -30
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_fwd.py 1 2 300 128 bf16 true ${TINY_VARIANT:-tma} > "$OUT/racecheck_tma.log" 2>&1; echo "racecheck tma rc=$?"; tail -2 "$OUT/racecheck_tma.log"
timeout 60 compute-sanitizer --tool synccheck python3 tools/tiny_fwd.py 1 2 300 64 bf16 false ${TINY_VARIANT:-tma} > "$OUT/synccheck_tma.log" 2>&1; echo "synccheck tma rc=$?"; tail -2 "$OUT/synccheck_tma.log"
timeout 60 compute-sanitizer --tool memcheck --report-api-errors no python3 tools/tiny_fwd.py 2 2 333 96 bf16 true ${TINY_VARIANT:-tma} > "$OUT/memcheck_tma.log" 2>&1; echo "memcheck tma rc=$?"; tail -2 "$OUT/memcheck_tma.log"
timeout "${SWEEP_TIMEOUT:-240}" python3 tools/hopper_fwd_sweep.py ${SWEEP_ARGS:-} --json "$OUT/fwd_sweep.json" > "$OUT/fwd_sweep.log" 2>&1; echo "sweep rc=$?"; cat "$OUT/fwd_sweep.log"
if [ -n "${FWD_TESTS:-}" ]; then
timeout 200 python3 -m pytest -q tests/test_gpu_forward.py -p no:cacheprovider -rfE --maxfail=40 \
    > "$OUT/fwd_tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/fwd_tests.log" | tail -45
fi
