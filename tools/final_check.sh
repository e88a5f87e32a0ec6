#!/usr/bin/env bash
# The final GPU check in one device call (fits the 10-minute limit): the whole GPU test suite,
# the side-by-side benchmarks (forward, backward, decode; separate budgets so none starves the
# others), merged into bench.json, and summary.json by tools/summarize.py.
#
#   OUT=dir GIT_COMMIT=<sha> bash tools/final_check.sh
# (write the sha out on this side: git on the device machine reports an older HEAD than the tree it runs)
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# PART=tests or PART=bench splits the check over two device calls (each under 10 minutes).
# A device call brings back at most 8 files from $OUT: this script writes 8 (nvidia-smi.txt,
# junit.xml, tests.log, paged.json, paged.log, bench.log, bench.json, summary.json), so a call that
# writes more of its own should pass a subfolder as OUT or pack its extras into one archive.
PART=${PART:-all}
if [ "$PART" != bench ]; then
# BLAS_THREADS (unset: the libraries' default, all cores per worker): threads of each xdist
# worker's float64 / naive references, so that more TEST_WORKERS need not oversubscribe the CPU.
if [ -n "${BLAS_THREADS:-}" ]; then
    export OPENBLAS_NUM_THREADS=$BLAS_THREADS OMP_NUM_THREADS=$BLAS_THREADS MKL_NUM_THREADS=$BLAS_THREADS
fi
timeout "${TEST_TIMEOUT:-230}" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rfE -n "${TEST_WORKERS:-2}" \
    --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -40; tail -3 "$OUT/tests.log"
fi
[ "$PART" = tests ] && exit 0
tmp=$(mktemp -d)
# GRID=full (with PART=bench: the whole call for it): forward and backward at every head dim in
# bf16 and fp16, N = 1k..16k - the Hopper issue's whole grid, 120 cells; otherwise the smaller grid
# that fits next to the tests in one call (bf16, fp16 at d=128; no 8k; backward at 4k and 16k).
if [ "${GRID:-}" = full ]; then
    fwd_grid=(--dtypes bfloat16,float16 --d 64,128,256 --n 1024,2048,4096,8192,16384); FWD_TIMEOUT=${FWD_TIMEOUT:-270}
    bwd_grid=(--dtypes bfloat16,float16 --d 64,128,256 --n 1024,2048,4096,8192,16384); BWD_TIMEOUT=${BWD_TIMEOUT:-200}
else
    fwd_grid=(--d 64,128,256 --n 1024,2048,4096,16384); FWD_TIMEOUT=${FWD_TIMEOUT:-170}
    bwd_grid=(--d 64,128,256 --n 4096,16384); BWD_TIMEOUT=${BWD_TIMEOUT:-140}
fi
timeout "$FWD_TIMEOUT" python3 benchmarks/peers.py --ops fwd "${fwd_grid[@]}" --max-seconds "$(( FWD_TIMEOUT - 20 ))" \
    --out "$tmp/fwd.json" > "$tmp/fwd.log" 2>&1; echo "fwd bench rc=$?"
timeout "$BWD_TIMEOUT" python3 benchmarks/peers.py --ops bwd "${bwd_grid[@]}" --impls cuflash,torch-flash,torch-cudnn \
    --max-seconds "$(( BWD_TIMEOUT - 15 ))" --out "$tmp/bwd.json" > "$tmp/bwd.log" 2>&1; echo "bwd bench rc=$?"
timeout 60 python3 benchmarks/peers.py --ops decode --impls cuflash,torch-flash,torch-cudnn,torch-efficient \
    --max-seconds 45 --out "$tmp/decode.json" > "$tmp/decode.log" 2>&1; echo "decode bench rc=$?"
# Decode shapes outside the issue's grid, against the same peers (grid_table lists them without a
# verdict): MQA with many query heads (the wide-rows blocks; FA2 leads there) and one B=1 MQA shape
# with short splits, two whose short splits take the wide rows (WIDE_SHORT_MIN_WAVES). MQA=0 skips it.
if [ "${MQA:-1}" = 1 ]; then
    timeout 50 python3 benchmarks/peers.py --ops decode --impls cuflash,torch-flash,torch-cudnn --max-seconds 40 --seconds-per-impl 0.8 \
        --decode-shapes 8x64x1x32768,64x64x1x16384,16x128x1x8192,1x64x1x32768,2x48x1x32768,4x64x1x16384,16x64x1x16384x64,64x48x1x16384x64,64x128x1x16384x64 \
        --out "$tmp/decode_mqa.json" > "$tmp/decode_mqa.log" 2>&1; echo "decode mqa bench rc=$?"
fi
timeout "${PAGED_TIMEOUT:-70}" python3 tools/paged_bench.py "$OUT/paged.json" > "$OUT/paged.log" 2>&1; echo "paged bench rc=$?"; grep PAGED "$OUT/paged.log"
cat "$tmp"/fwd.log "$tmp"/bwd.log "$tmp"/decode.log > "$OUT/bench.log"
[ -f "$tmp/decode_mqa.log" ] && cat "$tmp/decode_mqa.log" >> "$OUT/bench.log"
# Host time of one decode call, layer by layer (cached plan, uncached, prepared, torch SDPA), into bench.log.
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
python3 tools/summarize.py --junit "$OUT/junit.xml" --bench "$OUT/bench.json" --out "$OUT/summary.json" 2>&1 | tail -70
