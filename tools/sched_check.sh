#!/usr/bin/env bash
# Schedule-search evidence for the Hopper kernels plus one CLI autotune, in one device call,
# packed into one archive (the device returns only a few files).
#   OUT=dir bash tools/sched_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
work=$(mktemp -d)
timeout 260 python3 tools/schedule_search.py --ops fwd_wgmma,bwd_wgmma --ds 64,128,256 --budget-s 220 --out "$work/sched" \
    > "$work/sched_stdout.log" 2>&1; echo "schedule search rc=$?"; tail -30 "$work/sched_stdout.log"
CUFLASH_CACHE_DIR="$work/tunecache" timeout 120 python3 -m cuflash tune --shape 2,16,2048,128 --shape 4,32,1024,64 \
    --max-candidates 4 > "$work/tune_cli.log" 2>&1; echo "tune cli rc=$?"; tail -8 "$work/tune_cli.log"
tar -czf "$OUT/sched.tar.gz" -C "$work" .
