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
from torch.nn.attention import SDPBackend  # noqa: E402

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
    for i in range(PASSES):
        us = {"cudnn": case.peer_us(timer, SDPBackend.CUDNN_ATTENTION),
              "flash": case.peer_us(timer, SDPBackend.FLASH_ATTENTION)}
        for name, kw in (VARIANTS.items() if i % 2 == 0 else reversed(VARIANTS.items())):
            if name == "R2":  # (the original problem only: the library plans the doubled heads again)
                gpu_decode.row_blocks = lambda p_, sm_count=None: 2 if p_.hkv == 1 else 1
            us[name] = case.forward_us(timer, **kw)
            gpu_decode.row_blocks = planned
        row["passes"].append(us)
        best = min(us["cudnn"], us["flash"])
        print(f"B{B} H{hq}/1 L{L} d{d} [{row['planner']}] pass {i}: cudnn {us['cudnn']:.1f} flash {us['flash']:.1f} | "
              + ", ".join(f"{n} {best / x:.3f}" if isinstance(x, float) else f"{n} {x}"
                          for n, x in us.items() if n not in ("cudnn", "flash")), flush=True)
    out.append(row)
    del case
    json.dump(out, open(sys.argv[1], "w"), indent=1)
