#!/usr/bin/env bash
# Decode probe in one device call: tile/ring/split sweep against cuDNN and FA2 (decode_probe.py)
# and ncu of the default decode launch at a small and a large cell.   OUT=dir bash tools/decode_check.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
for cell in "4096 8 8" "16384 64 8"; do
  tag=$(echo $cell | tr ' ' _)
  timeout 120 ncu --clock-control none -k regex:attn_decode --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats python3 tools/decode_one.py $cell > "$OUT/ncu_$tag.txt" 2>&1
  echo "ncu $cell rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per|Stall|Grid Size|Block Limit" "$OUT/ncu_$tag.txt" | head -30
done
timeout ${PROBE_TIMEOUT:-400} python3 tools/decode_probe.py "$OUT/decode_probe.json" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/decode_probe.log" | grep -v Warning
