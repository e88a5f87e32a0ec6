#!/usr/bin/env bash
# L2 and tensor-pipe use of cuflash's and cuDNN's forward kernels (ncu): is the K/V traffic from L2 near its limit?
#   OUT=dir bash tools/ncu_fwd_l2.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum,dram__bytes_read.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,gpc__cycles_elapsed.avg.per_second
NCU_OPS="fwd:128,4096,0;fwd:64,1024,0;fwd:128,16384,0" timeout 300 ncu --clock-control none --profile-from-start off --metrics "$M" --csv python3 tools/ncu_peers.py > $OUT/ncu_fwd.csv 2> $OUT/ncu_fwd.err
echo rc=$?
python3 - $OUT/ncu_fwd.csv <<'PY'
import csv, io, sys
lines=[l for l in open(sys.argv[1]).read().splitlines() if l.startswith('"')]
cur={}
for r in csv.DictReader(io.StringIO("\n".join(lines))):
    cur.setdefault((r["ID"], r["Kernel Name"][:70]), {})[r["Metric Name"]]=r["Metric Value"]+" "+r["Metric Unit"]
for k,m in cur.items():
    print(k)
    for a,b in sorted(m.items()): print("   ",a,b)
PY
