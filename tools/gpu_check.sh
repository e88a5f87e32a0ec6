#!/usr/bin/env bash
# The GPU check: the GPU test suite, the benchmarks against torch's SDPA backends (forward,
# backward, decode, paged decode, decode host time), merged into bench.json, and summary.json
# written by tools/summarize.py, whose table is printed last. Run from anywhere on a GPU machine:
#
#   OUT=dir bash tools/gpu_check.sh
#
# Environment:
#   OUT            output folder (required); every file lands directly in it:
#                  nvidia-smi.txt, junit.xml, tests.log, paged.json, paged.log, bench.log,
#                  bench.json, summary.json (and ab.json, ab.log, asv_results.tar where asked for)
#   PART           all (default), tests (the test suite only) or bench (the benchmarks only)
#   GPU_CHECK_TESTS  pytest selection, default "-m gpu tests/"
#   TEST_WORKERS   pytest-xdist workers (used when pytest-xdist is installed; default 2)
#   TEST_TIMEOUT   seconds for the test suite (default: no limit)
#   BLAS_THREADS   threads of each worker's float64 references (default: the libraries' own)
#   GRID=none      no forward, backward or decode grid (only the benchmarks switched on below)
#   GRID=d128      forward and backward at d = 128, N = 4k, 16k (bf16)
#   GRID=corners   forward and backward at d = 64, 128, 256, N = 4k, 16k (bf16)
#   GRID=quick     forward and backward at d = 64, 128, 256, N = 1k, 4k, 16k (bf16; fp16 at d=128)
#   GRID=full      forward and backward at d = 64, 128, 256, N = 1k..16k, bf16 and fp16
#                  (otherwise a smaller grid: bf16, fp16 at d=128 only, backward at 4k and 16k)
#   MQA=0          skip the decode shapes with many query heads per K/V head
#   PAGED=0        skip the paged-cache benchmark (tools/paged_bench.py)
#   OPTIONS=1      also benchmark the score modifiers (benchmarks/options.py; OPTIONS_TIMEOUT, default 150)
#   FP8_DECODE=1   also benchmark the e4m3 K/V cache against the bf16 one (benchmarks/fp8_decode.py;
#                  FP8_DECODE_TIMEOUT, default 120)
#   HEAD_DIM_V=1  also benchmark v's head dim unlike q's ((192, 128), (128, 64); benchmarks/head_dim_v.py;
#                  HEAD_DIM_V_TIMEOUT, default 120)
#   FP8=1          also benchmark the float8_e4m3fn forward beside bf16 at d = 128, 256, N = 8k, 16k, causal
#                  and not (benchmarks/peers.py --fp8; FP8_TIMEOUT, default 120)
#   MLA=1          also benchmark the MLA (576, 512) decode against the copy rate (benchmarks/mla_decode.py;
#                  MLA_TIMEOUT, default 90)
#   FP8_BAND=1     also benchmark the float8_e4m3fn band kernel (windows, packed sequences) against its
#                  dense kernel (benchmarks/fp8_band.py; FP8_BAND_TIMEOUT, default 120)
#   HOST_PARTS=0   skip the decode host-time breakdown (tools/decode_host_parts.py)
#   GIT_COMMIT     commit id to record when .git is not present (else git rev-parse HEAD)
#   ASV=1          first record this commit's asv history run (tools/asv_history.sh: needs .asvrepo;
#                  ASV_WHEELS=dir installs asv from wheels first); results in $OUT/asv_results.tar
#   ASV_TIMEOUT    seconds for that run (default 220)
#   AB=dir         before anything else, time this checkout against the baseline tree in dir (cuflash/ and
#                  cuda_src/ of the commit a change replaces) in one process: tools/ab_trees.py, cell sets
#                  AB_CELLS (default fwd), AB_ROUNDS rounds (default 5), the kernels compiled first by
#                  AB_WARM processes (default 14; 0: inside the timed process), $OUT/ab.json and ab.log
#                  (AB_TIMEOUT, default 200)
#   AB_MIN=x       with AB and ASV=1: record the asv point only if the cells' median ratio (baseline time
#                  over this checkout's) is at least x and none is below AB_FLOOR (default 0), so that a
#                  call spends no asv time on a change that lost
#
# Exit status: non-zero when the tests, a benchmark or the summary failed.
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX would otherwise take most of the GPU's memory in whichever test worker imports it first.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PART=${PART:-all}
rc=0

echo "== nvidia-smi"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; head -15 "$OUT/nvidia-smi.txt"

# A kernel change against the code it replaces, both in this process (tools/ab_trees.py).
ab_ok=1
if [ -n "${AB:-}" ]; then
    echo "== A/B against $AB (tools/ab_trees.py --cells ${AB_CELLS:-fwd})"
    timeout "${AB_TIMEOUT:-200}" python3 tools/ab_trees.py --base "$AB" --cells "${AB_CELLS:-fwd}" \
        --rounds "${AB_ROUNDS:-5}" --warm "${AB_WARM:-14}" --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1
    r=$?; echo "ab rc=$r"; grep -E "^[a-z0-9]+: [0-9]+ cells" "$OUT/ab.log"
    if [ "$r" -ne 0 ]; then rc=1; ab_ok=0; tail -5 "$OUT/ab.log"; fi
    if [ "$r" -eq 0 ] && [ -n "${AB_MIN:-}" ]; then
        python3 - "$OUT/ab.json" "$AB_MIN" "${AB_FLOOR:-0}" <<'PY' || ab_ok=0
import json, statistics, sys
ratios = [r["ratio"] for r in json.load(open(sys.argv[1]))["cells"]]
med, low = statistics.median(ratios), min(ratios)
ok = med >= float(sys.argv[2]) and low >= float(sys.argv[3])
print(f"A/B: median ratio {med:.3f}, lowest {low:.3f}: the asv point is {'recorded' if ok else 'skipped'}")
sys.exit(0 if ok else 1)
PY
    fi
fi

# The asv point first: it is what lets a kernel change land, and a call that the device's time
# cuts short still records it.
if [ "${ASV:-0}" = 1 ] && [ "$ab_ok" = 1 ]; then
    echo "== asv (tools/asv_history.sh)"
    if [ -n "${ASV_WHEELS:-}" ]; then
        python3 -m pip install -q --no-index --find-links "$ASV_WHEELS" asv==0.6.6 > /dev/null 2>&1
    fi
    commit=${GIT_COMMIT:-$(git rev-parse HEAD)}
    timeout "${ASV_TIMEOUT:-220}" bash tools/asv_history.sh "$commit" 2>&1 | grep -v "cuflash imported from" | tail -12
    r=${PIPESTATUS[0]}; echo "asv rc=$r"; [ "$r" -ne 0 ] && rc=1
fi

if [ "$PART" != bench ]; then
    if [ -n "${BLAS_THREADS:-}" ]; then
        export OPENBLAS_NUM_THREADS=$BLAS_THREADS OMP_NUM_THREADS=$BLAS_THREADS MKL_NUM_THREADS=$BLAS_THREADS
    fi
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then workers=(-n "${TEST_WORKERS:-2}"); fi
    limit=()
    if [ -n "${TEST_TIMEOUT:-}" ]; then limit=(timeout "$TEST_TIMEOUT"); fi
    echo "== tests: ${GPU_CHECK_TESTS:=-m gpu tests/}"
    # -v names every test as it finishes: a run cut short by TEST_TIMEOUT still names its failures.
    # shellcheck disable=SC2086  # the selection is a list of pytest arguments
    "${limit[@]}" python3 -m pytest -v $GPU_CHECK_TESTS -p no:cacheprovider -rfE --durations=15 "${workers[@]}" \
        --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
    tests_rc=$?
    echo "tests rc=$tests_rc"; grep -E "(^| )(FAILED|ERROR) " "$OUT/tests.log" | sort -u | head -40
    grep -A 17 "slowest 15 durations" "$OUT/tests.log"; tail -3 "$OUT/tests.log"
    [ "$tests_rc" -ne 0 ] && rc=1
fi
[ "$PART" = tests ] && exit "$rc"

# Each benchmark's JSON lands in $OUT/bench-parts as it finishes, so a run cut short keeps them.
tmp="$OUT/bench-parts"
mkdir -p "$tmp"
if [ "${GRID:-}" = d128 ]; then  # d = 128 at N = 4k, 16k (bf16): the smallest check
    fwd_grid=(--d 128 --n 4096,16384 --seconds-per-impl 0.3); FWD_TIMEOUT=${FWD_TIMEOUT:-30}
    bwd_grid=(--d 128 --n 4096,16384 --seconds-per-impl 0.3); BWD_TIMEOUT=${BWD_TIMEOUT:-30}
elif [ "${GRID:-}" = corners ]; then  # d = 64, 128, 256 at N = 4k, 16k (bf16): a check that fits beside the suite and asv
    fwd_grid=(--d 64,128,256 --n 4096,16384 --seconds-per-impl 0.3); FWD_TIMEOUT=${FWD_TIMEOUT:-60}
    bwd_grid=(--d 64,128,256 --n 4096,16384 --seconds-per-impl 0.3); BWD_TIMEOUT=${BWD_TIMEOUT:-60}
elif [ "${GRID:-}" = quick ]; then  # the grid's corners: d = 64, 128, 256 at N = 1k, 4k, 16k, bf16 and fp16 at d = 128
    fwd_grid=(--d 64,128,256 --n 1024,4096,16384 --seconds-per-impl 0.4); FWD_TIMEOUT=${FWD_TIMEOUT:-110}
    bwd_grid=(--d 64,128,256 --n 1024,4096,16384 --seconds-per-impl 0.4); BWD_TIMEOUT=${BWD_TIMEOUT:-110}
elif [ "${GRID:-}" = full ]; then
    fwd_grid=(--dtypes bfloat16,float16 --d 64,128,256 --n 1024,2048,4096,8192,16384); FWD_TIMEOUT=${FWD_TIMEOUT:-270}
    bwd_grid=(--dtypes bfloat16,float16 --d 64,128,256 --n 1024,2048,4096,8192,16384); BWD_TIMEOUT=${BWD_TIMEOUT:-200}
else
    fwd_grid=(--d 64,128,256 --n 1024,2048,4096,16384); FWD_TIMEOUT=${FWD_TIMEOUT:-170}
    bwd_grid=(--d 64,128,256 --n 4096,16384); BWD_TIMEOUT=${BWD_TIMEOUT:-140}
fi
bench() {  # name timeout peers.py-arguments...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 benchmarks/peers.py "$@" --out "$tmp/$name.json" > "$tmp/$name.log" 2>&1
    local r=$?; echo "$name bench rc=$r"; [ "$r" -ne 0 ] && rc=1
    cat "$tmp/$name.log" >> "$OUT/bench.log"
}
: > "$OUT/bench.log"
if [ "${GRID:-}" != none ]; then
    bench fwd "$FWD_TIMEOUT" --ops fwd "${fwd_grid[@]}" --max-seconds "$(( FWD_TIMEOUT - 20 ))"
    bench bwd "$BWD_TIMEOUT" --ops bwd "${bwd_grid[@]}" --impls cuflash,torch-flash,torch-cudnn \
        --max-seconds "$(( BWD_TIMEOUT - 15 ))"
    bench decode "${DECODE_TIMEOUT:-60}" --ops decode --impls cuflash,torch-flash,torch-cudnn,torch-efficient \
        --max-seconds "$(( ${DECODE_TIMEOUT:-60} - 15 ))"
fi
# Decode shapes with many query heads per K/V head (MQA), against the same peers.
if [ "${MQA:-1}" = 1 ] && [ "${GRID:-}" != none ]; then
    bench decode_mqa 50 --ops decode --impls cuflash,torch-flash,torch-cudnn --max-seconds 40 --seconds-per-impl 0.8 \
        --decode-shapes 8x64x1x32768,64x64x1x16384,16x128x1x8192,1x64x1x32768,2x48x1x32768,4x64x1x16384,16x64x1x16384x64,64x48x1x16384x64,64x128x1x16384x64
fi
# float8_e4m3fn q, k, v on the e4m3 kernel, each shape after its bf16 rows (cuflash and torch's backends).
if [ "${FP8:-0}" = 1 ]; then
    bench fp8 "${FP8_TIMEOUT:-120}" --ops fwd --fp8 --d 128,256 --n 8192,16384 --impls cuflash,torch-flash,torch-cudnn \
        --seconds-per-impl 0.5 --max-seconds "$(( ${FP8_TIMEOUT:-120} - 20 ))"
fi
# Score modifiers (softcap, ALiBi, sinks) against the plain kernels and FlexAttention.
if [ "${OPTIONS:-0}" = 1 ]; then
    timeout "${OPTIONS_TIMEOUT:-150}" python3 benchmarks/options.py --out "$tmp/options.json" > "$tmp/options.log" 2>&1
    r=$?; echo "options bench rc=$r"; [ "$r" -ne 0 ] && rc=1; cat "$tmp/options.log" >> "$OUT/bench.log"
fi
if [ "${HEAD_DIM_V:-0}" = 1 ]; then
    timeout "${HEAD_DIM_V_TIMEOUT:-120}" python3 benchmarks/head_dim_v.py --out "$tmp/head_dim_v.json" > "$tmp/head_dim_v.log" 2>&1
    r=$?; echo "head_dim_v bench rc=$r"; [ "$r" -ne 0 ] && rc=1; cat "$tmp/head_dim_v.log" >> "$OUT/bench.log"
    tail -16 "$tmp/head_dim_v.log"
fi
if [ "${FP8_DECODE:-0}" = 1 ]; then
    timeout "${FP8_DECODE_TIMEOUT:-120}" python3 benchmarks/fp8_decode.py --out "$tmp/fp8_decode.json" > "$tmp/fp8_decode.log" 2>&1
    r=$?; echo "fp8 decode bench rc=$r"; [ "$r" -ne 0 ] && rc=1; cat "$tmp/fp8_decode.log" >> "$OUT/bench.log"
    tail -12 "$tmp/fp8_decode.log"
fi
if [ "${MLA:-0}" = 1 ]; then
    timeout "${MLA_TIMEOUT:-90}" python3 benchmarks/mla_decode.py --out "$tmp/mla_decode.json" > "$tmp/mla_decode.log" 2>&1
    r=$?; echo "mla decode bench rc=$r"; [ "$r" -ne 0 ] && rc=1; cat "$tmp/mla_decode.log" >> "$OUT/bench.log"
    tail -13 "$tmp/mla_decode.log"
fi
if [ "${FP8_BAND:-0}" = 1 ]; then
    timeout "${FP8_BAND_TIMEOUT:-120}" python3 benchmarks/fp8_band.py --out "$tmp/fp8_band.json" > "$tmp/fp8_band.log" 2>&1
    r=$?; echo "fp8 band bench rc=$r"; [ "$r" -ne 0 ] && rc=1; cat "$tmp/fp8_band.log" >> "$OUT/bench.log"
    tail -16 "$tmp/fp8_band.log"
fi
if [ "${PAGED:-1}" = 1 ]; then
    timeout "${PAGED_TIMEOUT:-70}" python3 tools/paged_bench.py "$OUT/paged.json" > "$OUT/paged.log" 2>&1
    echo "paged bench rc=$?"; grep PAGED "$OUT/paged.log"
fi
# Host time of one decode call, layer by layer (cached plan, uncached, prepared, torch SDPA).
if [ "${HOST_PARTS:-1}" = 1 ]; then
    echo "== decode host time (tools/decode_host_parts.py)" >> "$OUT/bench.log"
    (cd tools && timeout 90 python3 decode_host_parts.py --calls 300) >> "$OUT/bench.log" 2>&1; echo "host parts rc=$?"
fi

python3 - "$tmp" "$OUT/bench.json" <<'PY'
import json, sys, pathlib
parts = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))]
merged = dict(parts[0]) if parts else {}
merged["bench"] = [row for p in parts for row in p.get("bench", [])]
merged["ceilings_per_run"] = [p.get("ceilings") for p in parts]
merged["complete"] = all(p.get("complete", False) for p in parts)
pathlib.Path(sys.argv[2]).write_text(json.dumps(merged, indent=1))
print(f"merged {len(parts)} benchmark runs, {len(merged['bench'])} rows")
PY

echo "== summary ($OUT/summary.json)"
python3 tools/summarize.py --junit "$OUT/junit.xml" --bench "$OUT/bench.json" --out "$OUT/summary.json" 2>&1 | tail -70
[ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
echo "== gpu_check: exit $rc"
exit "$rc"
