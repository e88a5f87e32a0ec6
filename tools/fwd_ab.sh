#!/usr/bin/env bash
# A/B of a kernel change in one device call: the forward (AB_OPS=bwd: backward) benchmark (cuflash next to cuDNN,
# same process) of snapshots (snapX: git archive <commit> | tar -x -C snapX) and of this tree
# (HEAD), alternated against drift (SNAPS, default "A HEAD A HEAD"), then the forward GPU tests of
# this tree (AB_TESTS; TEST_TIMEOUT=0 skips them).
#   OUT=dir bash tools/fwd_ab.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
root=$PWD
i=0
for s in ${SNAPS:-A HEAD A HEAD}; do
    i=$((i + 1)); dir=$root/snap$s; [ "$s" = HEAD ] && dir=$root
    cd "$dir" && export PYTHONPATH=$PWD
    timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/peers.py --ops ${AB_OPS:-fwd} --impls cuflash,torch-cudnn --d ${AB_D:-64,128,256} \
        --n ${AB_N:-1024,2048,4096,16384} --max-seconds $(( ${BENCH_TIMEOUT:-100} - 10 )) --out "$OUT/fwd_${s}_$i.json" > "$OUT/fwd_${s}_$i.log" 2>&1
    echo "snap$s bench rc=$?"
done
cd "$root" && export PYTHONPATH=$PWD
python3 tools/ab_summary.py AB "$OUT/fwd_*_*.json"
[ "${TEST_TIMEOUT:-200}" = 0 ] && exit 0
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu ${AB_TESTS:-tests/test_gpu_hopper_tma.py tests/test_gpu_forward.py} \
    -p no:cacheprovider -rfE -n 4 > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -8
