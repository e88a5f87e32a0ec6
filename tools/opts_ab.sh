#!/usr/bin/env bash
# A/B of compile-time switches in one device call: the benchmark (cuflash next to cuDNN, same
# process) once per variant, each variant's kernels compiled with its own CUFLASH_NVRTC_OPTIONS,
# in the order given (repeat names to alternate against drift), then the GPU tests AB_TESTS with
# TEST_OPTS (TEST_TIMEOUT=0 skips them). A variant is name=opt1,opt2 (commas become spaces).
#   VARIANTS="base= p4=-DX=4,-DY=128 p4=-DX=4,-DY=128 base=" OUT=dir bash tools/opts_ab.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}" "${VARIANTS:?set VARIANTS}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
i=0
for var in $VARIANTS; do
    i=$((i + 1)); name=${var%%=*}; opts=${var#*=}; opts=${opts//,/ }
    CUFLASH_NVRTC_OPTIONS="$opts" timeout ${BENCH_TIMEOUT:-60} python3 benchmarks/peers.py --ops ${AB_OPS:-fwd} \
        --impls cuflash,torch-cudnn --d ${AB_D:-64,128} --n ${AB_N:-1024,2048,4096} --seconds-per-impl ${AB_SECONDS:-0.5} \
        --max-seconds $(( ${BENCH_TIMEOUT:-60} - 8 )) --out "$OUT/ab_${name}_$i.json" > "$OUT/ab_${name}_$i.log" 2>&1
    echo "$name ($opts) bench rc=$?"
done
python3 tools/ab_summary.py AB "$OUT/ab_*_*.json"
[ "${TEST_TIMEOUT:-150}" = 0 ] && exit 0
CUFLASH_NVRTC_OPTIONS="${TEST_OPTS:-}" timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu ${AB_TESTS:-tests/test_gpu_hopper_tma.py} \
    -p no:cacheprovider -rfE -n 4 > "$OUT/tests.log" 2>&1; echo "tests ($TEST_OPTS) rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -12
