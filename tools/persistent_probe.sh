#!/usr/bin/env bash
# Device probe for the persistent TMA forward (attn_fwd_wgmma_tma_persistent): its GPU tests,
# racecheck / synccheck / memcheck on 3 blocks walking several tiles, then the d=64 and d=128
# sweep next to cuDNN (bf16, N 1k-16k) against the per-tile TMA kernels.
#   OUT=dir bash tools/persistent_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_hopper_tma.py -k persistent -p no:cacheprovider -rfE -n 2 \
    --junitxml="$OUT/junit_persistent.xml" > "$OUT/persistent_tests.log" 2>&1; echo "persistent tests rc=$?"
grep -E "^FAILED|^E  |passed|failed" "$OUT/persistent_tests.log" | head -30
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_fwd.py 2 3 300 128 bf16 true persist > "$OUT/racecheck_persist.log" 2>&1; echo "racecheck rc=$?"; tail -2 "$OUT/racecheck_persist.log"
timeout 60 compute-sanitizer --tool synccheck python3 tools/tiny_fwd.py 2 3 500 64 bf16 false pppersist > "$OUT/synccheck_persist.log" 2>&1; echo "synccheck rc=$?"; tail -2 "$OUT/synccheck_persist.log"
timeout 60 compute-sanitizer --tool memcheck --report-api-errors no python3 tools/tiny_fwd.py 2 2 333 96 bf16 true pppersist > "$OUT/memcheck_persist.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/memcheck_persist.log"
timeout "${SWEEP_TIMEOUT:-300}" python3 tools/hopper_fwd_sweep.py --d 64,128 --n ${SWEEP_N:-1024,2048,4096,16384} --json "$OUT/fwd_sweep.json" > "$OUT/fwd_sweep.log" 2>&1; echo "sweep rc=$?"; cat "$OUT/fwd_sweep.log"
