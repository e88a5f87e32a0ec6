#!/usr/bin/env bash
# One GPU check on the lent machine: GPU tests, then the benchmark (if present), then a summary.
#
#   OUT=/some/dir bash tools/gpu_check.sh
#
# Environment:
#   OUT               output folder (required); every file lands directly in it (at most 6 files)
#   GPU_CHECK_TESTS   pytest selection, default "-m gpu tests/"
#   GPU_CHECK_BENCH   set to 0 to skip the benchmark
#   GPU_CHECK_BENCH_ARGS  extra arguments for benchmarks/peers.py, e.g. "--quick --max-seconds 300"
#   GIT_COMMIT        commit id to record when .git did not travel with the working tree
#
# Files: nvidia-smi.txt, tests.log, junit.xml, bench.log, bench.json, summary.json.
# Exit status: non-zero when the tests or the benchmark failed.
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"

echo "== tests: ${GPU_CHECK_TESTS:=-m gpu tests/}"
# shellcheck disable=SC2086  # the selection is a list of pytest arguments
python3 -m pytest -q $GPU_CHECK_TESTS -rs --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=$?

bench_rc=0
if [ "${GPU_CHECK_BENCH:-1}" != "0" ] && [ -f benchmarks/peers.py ]; then
    echo "== benchmark: benchmarks/peers.py ${GPU_CHECK_BENCH_ARGS:-}"
    # shellcheck disable=SC2086
    python3 benchmarks/peers.py ${GPU_CHECK_BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
else
    echo "== benchmark: skipped (benchmarks/peers.py absent or GPU_CHECK_BENCH=0)"
fi

echo "== gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc"
echo "== summary ($OUT/summary.json)"
python3 tools/summarize.py --junit "$OUT/junit.xml" --bench "$OUT/bench.json" --out "$OUT/summary.json"
summary_rc=$?
if [ "$tests_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ] || [ "$summary_rc" -ne 0 ]; then
    exit 1
fi
