#!/usr/bin/env bash
# Device probe for the backward's dQ variants (attn_bwd_kv_wgmma_tma DQ_MODE 1: red.v4 after a
# lane-pair shuffle, 2: shared-memory tile + bulk reduce-add per row): their GPU tests, racecheck
# and memcheck of the bulk variant, and the sweep next to cuDNN (bf16, d 64/128, N 4k/16k).
#   OUT=dir bash tools/bwd_dq_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_hopper_bwd_tma.py -k dq_modes -p no:cacheprovider -rfE -n 2 \
    --junitxml="$OUT/junit_dq.xml" > "$OUT/dq_tests.log" 2>&1; echo "dq tests rc=$?"
grep -E "^FAILED|^E  |passed|failed" "$OUT/dq_tests.log" | head -20
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_bwd.py 1 2 300 128 bf16 true bulk > "$OUT/racecheck_bulk.log" 2>&1; echo "racecheck rc=$?"; tail -2 "$OUT/racecheck_bulk.log"
timeout 60 compute-sanitizer --tool memcheck --report-api-errors no python3 tools/tiny_bwd.py 2 2 333 64 bf16 true bulk > "$OUT/memcheck_bulk.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/memcheck_bulk.log"
DQ_MODES=1,2 timeout "${SWEEP_TIMEOUT:-150}" python3 tools/hopper_bwd_sweep.py --n 4096,16384 --json "$OUT/bwd_sweep.json" > "$OUT/bwd_sweep.log" 2>&1
echo "sweep rc=$?"; cat "$OUT/bwd_sweep.log"
