#!/usr/bin/env bash
# Device probe for the wgmma kernels: diagnosis, GPU tests of the backward, sanitizer, the K/V
# kernel's dQ cost, a quick benchmark, the Hopper forward's schedule search and one autotune
# through the CLI.   OUT=dir bash tools/hopper_probe.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 90 python3 tools/hopper_diag.py > "$OUT/diag.log" 2>&1; echo "diag rc=$?"; grep -E "BAD" "$OUT/diag.log" | head -20
timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_bwd.py 1 2 300 64 bf16 true > "$OUT/racecheck_bwd.log" 2>&1; echo "racecheck bwd rc=$?"; tail -1 "$OUT/racecheck_bwd.log"
timeout 60 python3 tools/bwd_kv_probe.py > "$OUT/kv_probe.log" 2>&1; echo "kv probe rc=$?"; cat "$OUT/kv_probe.log"
timeout 100 python3 benchmarks/peers.py --ops bwd --d 64,128 --n 4096,16384 --impls cuflash,torch-flash,torch-cudnn \
    --max-seconds 80 --out "$OUT/bwd_wgmma.json" > "$OUT/bwd_wgmma.log" 2>&1; echo "bench rc=$?"; tail -13 "$OUT/bwd_wgmma.log"
timeout 200 python3 -m pytest -q tests/test_gpu_backward.py -p no:cacheprovider -rfE --maxfail=40 \
    > "$OUT/bwd_tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|^XPASS|passed|failed" "$OUT/bwd_tests.log" | tail -45
if [ "${SCHED:-1}" = 1 ]; then
  mkdir -p "$OUT/sched"
  timeout 230 python3 tools/schedule_search.py --ops fwd_wgmma --ds 64,128 --budget-s 170 --out "$OUT/sched" > "$OUT/sched/log.txt" 2>&1
  echo "schedule search rc=$?"; tail -5 "$OUT/sched/log.txt"
  CUFLASH_CACHE_DIR="$OUT/tunecache" timeout 90 python3 -m cuflash tune --shape 2,16,2048,128 --max-candidates 4 > "$OUT/tune_cli.log" 2>&1
  echo "tune cli rc=$?"; tail -6 "$OUT/tune_cli.log"; ls "$OUT/tunecache" 2>&1 | head
fi
