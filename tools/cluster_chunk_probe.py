"""Where the cluster merge should stop (GPU machine): the planner's own launch with
gpu_decode.CLUSTER_MAX_CHUNK at 4096 (as committed), 3072 and 2048, on the shapes whose plans it
changes (3-7 wanted splits rounded to 4, or 2, with 3-4k keys per split; d = 128 and 64), next to
cuDNN in each pass (benchmarks.peers.Timer: L2 flushed, launch hidden), alternating the order.
tools/cluster_edge_probe.py measured B=8 Hkv=8 d=128 alone: at 16k (4 x 4096 keys) splits merged
by the last split beat the 4-block cluster by 0.5-1.3%, at 12k (4 x 3072) the cluster stayed ahead.
Run on d02e677 (evidence-20261201e/probes/cluster_chunk.*), when CLUSTER_MAX_CHUNK bounded both
cluster sizes; since a31f934 4-block clusters stop at CLUSTER4_MAX_CHUNK (and hold one row tile),
so the limits varied here move the 2-block clusters only.

    python3 tools/cluster_chunk_probe.py out.json [passes]
"""
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False  # each limit must reach the plan
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 3
LIMITS = (4096, 3072, 2048)
SHAPES = [  # (B, Hq, Hkv, L, d)
    (8, 32, 8, 16384, 128), (8, 32, 8, 14336, 128), (16, 32, 8, 8192, 128), (4, 32, 32, 8192, 128),
    (2, 32, 32, 16384, 128), (8, 64, 8, 16384, 128), (16, 32, 4, 16384, 128), (64, 32, 1, 16384, 128),
    (8, 32, 8, 16384, 64), (16, 32, 8, 8192, 64), (64, 32, 1, 16384, 64),
]
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.25)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, hkv, L, d in SHAPES:
    case = ProbeCase(L, B, hkv, hq, d)
    row = {"B": B, "hq": hq, "hkv": hkv, "L": L, "d": d, "plans": {}}
    for lim in LIMITS:
        gpu_decode.CLUSTER_MAX_CHUNK = lim
        lp = gpu_decode.launch_plan(case.p, sms)
        row["plans"][lim] = f"{lp.splits}x{lp.chunk} {'cluster' if lp.cluster else 'memory'} ring{getattr(lp.tile, 'ring', '-')}"
    def with_limit(lim):
        gpu_decode.CLUSTER_MAX_CHUNK = lim
        return case.forward_us(timer)

    row["passes"] = case.alternate(timer, {lim: lambda lim=lim: with_limit(lim) for lim in LIMITS}, PASSES,
                                   f"B{B} H{hq}/{hkv} L{L} d{d}", row["plans"], peers=("cudnn",), digits=4)
    gpu_decode.CLUSTER_MAX_CHUNK = LIMITS[0]
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
