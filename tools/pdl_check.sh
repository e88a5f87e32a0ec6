#!/usr/bin/env bash
# Programmatic dependent launch on the GPU, in one device call: the PDL mechanism test and every
# decode test (its combine kernel is a PDL dependent), then decode's combine with and without PDL
# next to cuDNN (tools/pdl_decode_probe.py). (The forward tail split it also probed, 0fb8cd3, lost
# and was removed: benchmarks/results/evidence-20261130g/tail_probe.log.)
#   OUT=dir bash tools/pdl_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 200 python3 -m pytest -q -m gpu -n 4 tests/test_gpu_pdl.py tests/test_gpu_decode.py \
    tests/test_paged.py tests/test_kv_lens.py -p no:cacheprovider -rfE \
    > "$OUT/pdl_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pdl_tests.log" | tail -14
timeout 150 python3 tools/pdl_decode_probe.py "$OUT/pdl_decode.json" > "$OUT/pdl_decode.log" 2>&1
echo "decode probe rc=$?"; grep DECODE "$OUT/pdl_decode.log"
