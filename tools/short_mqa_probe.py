"""Split counts for MQA decode with few sequences (GPU machine): B = 1-4, Hkv = 1, many query heads,
where cuDNN is the faster peer (B=1 Hq=64 L=32k d=128: cuDNN 20.3 us, ours 22.5, FA2 40). The planner
runs the table's one-row-tile blocks there (row_blocks blocks per K/V head, each reading the cache,
the repeats from L2) in ~2 waves of splits. Variants: the planner, the table's tile at half and twice
its splits and at one wave (waves=1), and the wide-rows tile (one block reads each key once for
all rows) at its own split count and at one / two blocks per SM; next to cuDNN and FA2 (torch SDPA;
benchmarks.peers.Timer: L2 flushed, launch hidden), alternating the order.

    python3 tools/short_mqa_probe.py out.json [passes]
PROBE_SHAPES="B,Hq,L,d;..." replaces the shapes.
"""
import json
import os
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SHAPES = [  # (B, Hq, L, d)
    (1, 64, 32768, 128), (1, 64, 131072, 128), (2, 64, 16384, 128), (4, 64, 16384, 128),
    (1, 128, 32768, 64), (2, 48, 32768, 128),
]
if os.environ.get("PROBE_SHAPES"):
    SHAPES = [tuple(int(x) for x in s.split(",")) for s in os.environ["PROBE_SHAPES"].split(";")]
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, L, d in SHAPES:
    case = ProbeCase(L, B, 1, hq, d, 1)
    p = case.p
    lp = gpu_decode.launch_plan(p, sms)
    wide = schedule.DECODE_TILES_WIDE_ROWS[d]
    variants = {"rule": {}, "half": dict(splits=max(1, lp.splits // 2)), "twice": dict(splits=2 * lp.splits),
                "w1": dict(waves=1), "wide": dict(tile=wide), "wide-1x": dict(tile=wide, splits=sms // B),
                "wide-2x": dict(tile=wide, splits=2 * sms // B)}
    plans = {}
    for name, kw in list(variants.items()):
        try:
            q = gpu_decode.launch_plan(p, sms, **kw)
            plans[name] = f"{q.splits}x{q.chunk} rt{q.row_tiles} ring{q.tile.ring}"
        except ValueError as e:
            print(name, e)
            del variants[name]
    row = {"B": B, "hq": hq, "L": L, "d": d, "plans": plans}
    row["passes"] = case.alternate(timer, {n: lambda kw=kw: case.forward_us(timer, **kw) for n, kw in variants.items()},
                                   PASSES, f"B{B} H{hq}/1 L{L} d{d}", plans)
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
