#!/usr/bin/env bash
# Device call(s) for the branches that wait on a GPU run before they can merge (all three: about
# 9 minutes; only the snap-* folders present run, so split them over calls if needed):
#   next/wg-epilogue      persistent forward with a per-warpgroup epilogue as the rule tiles
#   next/bwd-async-stats  the wgmma backward's lse/D fetched by cp.async instead of a blocking load
#   next/bwd-ws           the warp-specialized backward (producer + dQ warp, bulk dQ adds): tests, sweep
# Each runs from its own snapshot (its GPU tests touched by the change, then its sweep vs cuDNN).
# Prepare on this machine, then run on the device from the repo root:
#   for b in wg-epilogue bwd-async-stats bwd-ws; do rm -rf snap-$b && mkdir snap-$b && git archive next/$b | tar -x -C snap-$b; done
#   OUT=dir bash tools/branches_probe.sh
# A branch that passes and wins still needs the whole GPU suite and the benchmark on the merged
# commit (tools/final_check.sh) before main takes it. Delete the snap-* folders afterwards.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
if [ -d snap-wg-epilogue ]; then
    cd snap-wg-epilogue && export PYTHONPATH=$PWD
    timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_hopper_tma.py tests/test_gpu_forward.py tests/test_tma_maps.py \
        -k "persistent or hopper_runs or default_tile" -p no:cacheprovider -rfE -n 2 --junitxml="$OUT/junit_wgepi.xml" \
        > "$OUT/wgepi_tests.log" 2>&1; echo "wg-epilogue tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/wgepi_tests.log" | tail -12
    timeout 90 python3 tools/hopper_fwd_sweep.py --d 128,64 --n 1024,2048,4096 --json "$OUT/wgepi_sweep.json" \
        > "$OUT/wgepi_sweep.log" 2>&1; echo "wg-epilogue sweep rc=$?"; cat "$OUT/wgepi_sweep.log"
    cd "$root"
fi
if [ -d snap-bwd-async-stats ]; then
    cd snap-bwd-async-stats && export PYTHONPATH=$PWD
    timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_hopper_bwd_tma.py tests/test_gpu_backward.py -p no:cacheprovider \
        -rfE -n 2 --junitxml="$OUT/junit_bwdstats.xml" > "$OUT/bwdstats_tests.log" 2>&1
    echo "bwd-async-stats tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/bwdstats_tests.log" | tail -12
    timeout 100 python3 tools/hopper_bwd_sweep.py --n 4096,16384 --json "$OUT/bwdstats_sweep.json" \
        > "$OUT/bwdstats_sweep.log" 2>&1; echo "bwd-async-stats sweep rc=$?"; cat "$OUT/bwdstats_sweep.log"
    cd "$root"
fi
if [ -d snap-bwd-ws ]; then
    cd snap-bwd-ws && export PYTHONPATH=$PWD
    timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_hopper_bwd_tma.py -k warp_specialized -p no:cacheprovider \
        -rfE -n 2 --junitxml="$OUT/junit_bwdws.xml" > "$OUT/bwdws_tests.log" 2>&1
    echo "bwd-ws tests rc=$?"; grep -E "^FAILED|^E  |passed|failed" "$OUT/bwdws_tests.log" | head -20
    timeout 60 compute-sanitizer --tool racecheck python3 tools/tiny_bwd.py 1 2 300 128 bf16 true ws > "$OUT/bwdws_racecheck.log" 2>&1
    echo "racecheck ws rc=$?"; tail -2 "$OUT/bwdws_racecheck.log"
    timeout 60 compute-sanitizer --tool synccheck python3 tools/tiny_bwd.py 2 2 333 64 bf16 true ws > "$OUT/bwdws_synccheck.log" 2>&1
    echo "synccheck ws rc=$?"; tail -2 "$OUT/bwdws_synccheck.log"
    timeout 100 python3 tools/hopper_bwd_sweep.py --n 4096,16384 --json "$OUT/bwdws_sweep.json" \
        > "$OUT/bwdws_sweep.log" 2>&1; echo "bwd-ws sweep rc=$?"; cat "$OUT/bwdws_sweep.log"
    cd "$root"
fi
