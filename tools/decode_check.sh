#!/usr/bin/env bash
# Decode probe in one device call: the decode GPU tests, a tile/ring/split sweep of both decode
# kernels against cuDNN and FA2 (decode_probe.py, with a host profile), ncu of the default launch.
#   OUT=dir bash tools/decode_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_kv_lens.py -p no:cacheprovider -rfE -x \
    > "$OUT/decode_tests.log" 2>&1; echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/decode_tests.log" | tail -12
timeout ${PROBE_TIMEOUT:-300} python3 tools/decode_probe.py "$OUT/decode_probe.json" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/decode_probe.log" | grep -v Warning | grep -E "DECODE|Error|error|tottime|cuflash|cupy" | head -60
for cell in ${NCU_CELLS:-"4096 8 8"}; do
  tag=$(echo $cell | tr ' ' _)
  timeout 100 ncu --clock-control none -k regex:attn_decode --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
      python3 tools/decode_one.py $cell > "$OUT/ncu_$tag.txt" 2>&1
  echo "ncu $cell rc=$?"
  grep -E "attn_decode|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Waves Per" "$OUT/ncu_$tag.txt" | head -20
done
