#!/usr/bin/env bash
# DRAM bytes and rate of cuflash's and cuDNN's decode kernels on the cells short of cuDNN (ncu,
# clocks as they run): does cuflash read more than the cache, or read it more slowly?
#   OUT=dir bash tools/ncu_decode_bytes.sh
set -u
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
M=$M,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
M=$M,l1tex__m_xbar2l1tex_read_bytes.sum,dram__sectors_read.sum
NCU_OPS="${NCU_OPS:-decode:8,32,65536;decode:64,8,4096;decode:8,8,65536}" timeout 400 \
    ncu --clock-control none --profile-from-start off --metrics "$M" --csv python3 tools/ncu_peers.py \
    > "$OUT/ncu_decode_bytes.csv" 2> "$OUT/ncu_decode_bytes.err"
echo "ncu rc=$?"; tail -3 "$OUT/ncu_decode_bytes.err"
python3 - "$OUT/ncu_decode_bytes.csv" <<'PY'
import csv, io, sys
text = open(sys.argv[1]).read()
lines = [l for l in text.splitlines() if l.startswith('"')]
rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
cur = {}
for r in rows:
    key = (r["ID"], r["Kernel Name"][:60])
    cur.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
for (i, name), m in cur.items():
    print(i, name)
    for k, (v, u) in sorted(m.items()):
        print(f"    {k:60s} {v} {u}")
PY
