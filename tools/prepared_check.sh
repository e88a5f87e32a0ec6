#!/usr/bin/env bash
# One device call (sixteenth session): the GPU tests of the decode paths (prepared calls, the
# refactored gpu_decode launch, graph capture, PDL), the host time of a decode call by layer
# (cuflash.attention vs prepare_attention vs torch SDPA), and three passes of ring 0 vs ring 1
# on the split (cluster) cells at 4k / 8k / 16k.
#   OUT=dir bash tools/prepared_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -n "${TEST_WORKERS:-6}" \
    tests/test_gpu_prepared.py tests/test_gpu_decode.py tests/test_gpu_graph_capture.py tests/test_gpu_pdl.py \
    tests/test_paged.py tests/test_kv_lens.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30; tail -3 "$OUT/tests.log"
(cd tools && timeout 120 python3 decode_host_parts.py --calls 300) > "$OUT/host_parts.txt" 2>&1
echo "host parts rc=$?"; cat "$OUT/host_parts.txt" | tail -30
if [ "${PROBE:-1}" = 1 ]; then
for i in 1 2 3; do
    DECODE_LENS=4096,8192,16384 DECODE_CANDS="16,4,2;16,4,2,1" DECODE_WAVES=2 timeout 100 \
        python3 tools/decode_probe.py "$OUT/split_$i.json" --split-cells 2>&1 | grep DECODE
done > "$OUT/split.log"
cat "$OUT/split.log"
fi
