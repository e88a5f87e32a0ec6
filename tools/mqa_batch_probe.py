"""MQA with many sequences (GPU machine): one K/V head, 32 or 64 query heads, B = 16-128, L = 2k-8k,
d = 64 / 128 - blocks of 2-4 row tiles. The planner's launch next to forced split counts merged
through memory (1 / 2 / 4 / 8), 2- and 4-block clusters, and row blocks of half the heads (R=2,
the planner's splits for the doubled heads), cuDNN and FlashAttention-2 (torch SDPA) each pass
(benchmarks.peers.Timer: L2 flushed, launch hidden), alternating the order; x the faster peer.

    python3 tools/mqa_batch_probe.py out.json [passes]
"""
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False  # the forced row blocks must reach every plan
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SHAPES = [  # (B, Hq, L, d); Hkv = 1
    (64, 32, 4096, 128), (128, 32, 2048, 128), (128, 32, 8192, 128), (64, 64, 4096, 128), (32, 32, 4096, 128),
    (16, 32, 8192, 128), (64, 64, 4096, 64), (128, 32, 4096, 64), (128, 64, 2048, 64), (32, 64, 8192, 64),
]
VARIANTS = {"planner": {}, "mem1": dict(splits=1, cluster=False), "mem2": dict(splits=2, cluster=False),
            "mem4": dict(splits=4, cluster=False), "mem8": dict(splits=8, cluster=False),
            "cl2": dict(splits=2, cluster=True), "cl4": dict(splits=4, cluster=True), "R2": {}}
planned = gpu_decode.row_blocks
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.2)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, L, d in SHAPES:
    case = ProbeCase(L, B, 1, hq, d)
    row = {"B": B, "hq": hq, "L": L, "d": d, "planner": str(gpu_decode.launch_plan(case.p, sms)[2:]), "passes": []}
    def run(name, kw):
        if name == "R2":  # (the original problem only: the library plans the doubled heads again)
            gpu_decode.row_blocks = lambda p_, sm_count=None: 2 if p_.hkv == 1 else 1
        try:
            return case.forward_us(timer, **kw)
        finally:
            gpu_decode.row_blocks = planned

    row["passes"] = case.alternate(timer, {n: lambda n=n, kw=kw: run(n, kw) for n, kw in VARIANTS.items()}, PASSES,
                                   f"B{B} H{hq}/1 L{L} d{d} [{row['planner']}]")
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
