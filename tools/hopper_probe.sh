#!/usr/bin/env bash
# Device probe for the wgmma forward: diagnosis, warp-specialized tile sweep, sanitizers on the
# warp-specialized variant, the forward GPU tests.   OUT=dir bash tools/hopper_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 120 python3 tools/hopper_diag.py > "$OUT/diag.log" 2>&1; echo "diag rc=$?"; grep -E "BAD" "$OUT/diag.log" | head -20
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_fwd.py 1 2 300 128 bf16 true ws > "$OUT/racecheck_ws.log" 2>&1; echo "racecheck ws rc=$?"; tail -2 "$OUT/racecheck_ws.log"
timeout 60 compute-sanitizer --tool synccheck python3 tools/tiny_fwd.py 1 2 300 64 bf16 false ws > "$OUT/synccheck_ws.log" 2>&1; echo "synccheck ws rc=$?"; tail -2 "$OUT/synccheck_ws.log"
timeout 150 python3 tools/hopper_fwd_sweep.py > "$OUT/fwd_sweep.log" 2>&1; echo "sweep rc=$?"; cat "$OUT/fwd_sweep.log"
timeout 200 python3 -m pytest -q tests/test_gpu_forward.py -p no:cacheprovider -rfE --maxfail=40 \
    > "$OUT/fwd_tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/fwd_tests.log" | tail -45
