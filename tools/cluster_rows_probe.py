"""The cluster merge against splits merged through memory, same split count (GPU machine): the
planner's launch (cluster) next to splits=<its count>, cluster=False (the workspace, merged by the
last split where it can), on the shapes that cluster blocks of 2-4 row tiles (MQA with B >= 32) and
on one-row-tile clusters of 2-3k keys per split, next to cuDNN each pass (benchmarks.peers.Timer:
L2 flushed, launch hidden), alternating the order. tools/cluster_chunk_probe.py found B=64 Hq=32
Hkv=1 at 16k 0.83x cuDNN in the cluster against 1.21x through memory (d=128; d=64 1.09 vs 1.56).

    python3 tools/cluster_rows_probe.py out.json [passes]
"""
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 3
SHAPES = [  # (B, Hq, Hkv, L, d)
    (64, 32, 1, 4096, 128), (64, 32, 1, 8192, 128), (64, 32, 1, 12288, 128), (32, 64, 1, 8192, 128),
    (64, 64, 1, 4096, 128), (128, 32, 1, 2048, 128), (128, 32, 1, 8192, 128),
    (64, 32, 1, 4096, 64), (64, 32, 1, 8192, 64), (64, 64, 1, 4096, 64), (128, 32, 1, 4096, 64),
    (2, 32, 32, 12288, 128), (8, 64, 8, 12288, 128), (16, 32, 4, 12288, 128), (16, 32, 8, 4096, 128),
    (16, 32, 8, 6144, 128), (8, 32, 8, 12288, 64), (16, 32, 8, 6144, 64),
]
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.25)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, hkv, L, d in SHAPES:
    case = ProbeCase(L, B, hkv, hq, d)
    lp = gpu_decode.launch_plan(case.p, sms)
    variants = {"planner": {}, "memory": dict(splits=lp.splits, cluster=False)}
    plans = {name: gpu_decode.launch_plan(case.p, sms, **kw) for name, kw in variants.items()}
    row = {"B": B, "hq": hq, "hkv": hkv, "L": L, "d": d, "passes": [],
           "plans": {n: f"{x.splits}x{x.chunk} rt{x.row_tiles} {'cluster' if x.cluster else 'memory'} "
                        f"ring{getattr(x.tile, 'ring', '-')}" for n, x in plans.items()}}
    row["passes"] = case.alternate(timer, {n: lambda kw=kw: case.forward_us(timer, **kw) for n, kw in variants.items()},
                                   PASSES, f"B{B} H{hq}/{hkv} L{L} d{d}", row["plans"], peers=("cudnn",), digits=4)
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
