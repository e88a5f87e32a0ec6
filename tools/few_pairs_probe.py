"""Head dims 192 / 256 with fewer (sequence, K/V head) pairs than SMs (GPU machine): the planner
against schedule.DECODE_TILES_FEW_PAIRS' 2-warp blocks and the table's 4-warp tile, each at its own
split count, Hq=32 Hkv=8 bf16, B = 1-8, L = 4k-64k; next to cuDNN and FA2 (torch SDPA) each pass
(benchmarks.peers.Timer: L2 flushed, launch hidden), alternating the order; x = the faster peer's
time / the variant's. The 2-warp tile was measured when 4-8 splits merged in clusters; since
a31f934 4 splits of more than 3072 keys merge through memory.

    python3 tools/few_pairs_probe.py out.json [passes]
"""
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 3
SHAPES = [(B, L, d) for d in (192, 256) for B, L in ((1, 65536), (2, 32768), (4, 16384), (8, 4096), (8, 16384), (8, 65536))]
SHAPES += [(1, 2048, 192), (1, 4096, 192), (2, 4096, 192), (4, 4096, 192), (4, 8192, 192), (16, 16384, 192)]
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
sms = gpu_decode._sm_count(0)
out = []
for B, L, d in SHAPES:
    case = ProbeCase(L, B, 8, 32, d)
    variants = {"planner": {}, "2warp": dict(tile=schedule.DECODE_TILES_FEW_PAIRS[d]),
                "4warp": dict(tile=schedule.DECODE_TILES[d])}
    plans = {}
    for name, kw in variants.items():
        lp = gpu_decode.launch_plan(case.p, sms, **kw)
        plans[name] = f"{lp.tile.warps}w {lp.splits}x{lp.chunk}{' cl' if lp.cluster else ''}"
    row = {"B": B, "L": L, "d": d, "plans": plans}
    row["passes"] = case.alternate(timer, {n: lambda kw=kw: case.forward_us(timer, **kw) for n, kw in variants.items()},
                                   PASSES, f"B{B} H32/8 L{L} d{d}", plans)
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
