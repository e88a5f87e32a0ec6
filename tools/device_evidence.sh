#!/usr/bin/env bash
# Evidence run on the GPU machine (one call): measured DRAM traffic beside the IO model
# (cuflash report --measure), the tile schedule search, the asv history and a forward sweep.
#
#   OUT=dir GIT_COMMIT=<sha> bash tools/device_evidence.sh [OLD_SHA ...]
#
# Files under $OUT: report_measure.txt, schedule_search.{json,_fwd.md,_bwd.md}, asv_results.tar,
# sweep.json, evidence.log. Each stage has its own time limit so one slow stage cannot eat the call.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
exec > >(tee "$OUT/evidence.log") 2>&1

echo "== report --measure (ncu DRAM bytes vs model)"
{
    for causal in "" "--causal"; do
        for bn in 16,1024 4,4096 1,16384; do
            b=${bn%,*}; n=${bn#*,}
            timeout 60 python3 -m cuflash report --shape "$b,16,$n,128" $causal --measure
        done
    done
    timeout 60 python3 -m cuflash report --shape 8,32,1,128 --hkv 8 --decode 16384 --causal --measure
} > "$OUT/report_measure.txt" 2>&1
grep -iE "measured|dram|error" "$OUT/report_measure.txt" | head -20

echo "== schedule search"
timeout "${SEARCH_TIMEOUT:-200}" python3 tools/schedule_search.py --out "$OUT" --budget-s "${SEARCH_BUDGET:-150}" 2>&1 | tail -15

echo "== forward sweep d=128 (eager rescale with 32-key tiles)"
timeout 90 python3 tools/fwd_sweep.py --no-check --d 128 --n 4096,16384 --out "$OUT/sweep.json" 2>&1 | tail -5

echo "== asv history"
ASV_TIMEOUT=${ASV_TIMEOUT:-120} bash tools/asv_history.sh "$GIT_COMMIT" "$@" 2>&1 | grep -E "== asv|failed|Error|error" | head -20
echo "== done"
