"""One decode launch to profile under ncu (GPU machine): the wide-rows tile (ring 3) at d=128, Hq=64
Hkv=1, one split (the end writes O) or several (partials), so that ncu's source page can attribute
the block's start and end (block trace: 2.6 / 3.3-5.4 us with 64 rows against 1.0 / 1.0 with one).

    ncu --clock-control none -k regex:attn_decode --launch-skip 3 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python3 tools/wide_source_probe.py B L SPLITS > out.csv
"""
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

plan_cache.enabled = False
B, L, S = (int(x) for x in sys.argv[1:4])
case = ProbeCase(L, B, 1, 64, 128, 1)
for _ in range(5):
    gpu_decode.forward(case.p, case.qc, case.kc, case.vc, case.o4, case.lse3, tile=schedule.DECODE_TILES_WIDE_ROWS[128],
                       splits=S, merge="kernel")
import cupy  # noqa: E402

cupy.cuda.Device().synchronize()
