"""Wide-rows decode blocks against the planner (GPU machine): one K/V head with 32-128 query heads
(MQA), d = 64 / 128, B = 1-64, L = 4k-32k. Variants: the planner's launch; tile =
schedule.DECODE_TILES_WIDE_ROWS[d] (a row tile per warp over the block ring's keys) with its own
split count, twice that, merged by the last split, with three stages, and as 2-warp blocks; next to cuDNN and FA2 (torch SDPA) each pass
(benchmarks.peers.Timer: L2 flushed, launch hidden), alternating the order; x the faster peer.

    python3 tools/wide_rows_probe.py out.json [passes]
"""
import dataclasses
import json
import sys

sys.path.insert(0, ".")
from torch.nn.attention import SDPBackend  # noqa: E402

from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SHAPES = [  # (B, Hq, L, d); Hkv = 1
    (1, 64, 32768, 128), (8, 64, 32768, 128), (16, 64, 4096, 128), (32, 64, 16384, 128), (64, 64, 4096, 128),
    (8, 32, 32768, 128), (64, 32, 4096, 128), (1, 128, 16384, 128),
    (8, 64, 16384, 64), (32, 64, 8192, 64), (64, 64, 4096, 64), (128, 64, 2048, 64), (64, 48, 16384, 64),
]
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, L, d in SHAPES:
    case = ProbeCase(L, B, 1, hq, d)
    p = case.p
    wide = schedule.DECODE_TILES_WIDE_ROWS[d]
    n = gpu_decode.launch_plan(p, sms, tile=wide).splits
    # (also compiled at run time, not in the table: three stages (one block per SM at d=128), and
    # 2-warp blocks of 32 rows, two row blocks for Hq=64)
    variants = {"planner": {}, "wide": dict(tile=wide), "wide-2x": dict(tile=wide, splits=2 * n),
                "wide-last": dict(tile=wide, merge="last"),
                "wide-s3": dict(tile=dataclasses.replace(wide, stages=3)),
                "wide-w2": dict(tile=dataclasses.replace(wide, warps=2, max_row_tiles=2))}
    plans = {}
    for name, kw in variants.items():
        lp = gpu_decode.launch_plan(p, sms, **{k_: v_ for k_, v_ in kw.items() if k_ != "merge"})
        plans[name] = f"{lp.splits}x{lp.chunk} rt{lp.row_tiles} ring{lp.tile.ring}{' cl' if lp.cluster else ''}"
    row = {"B": B, "hq": hq, "L": L, "d": d, "plans": plans, "passes": []}
    for i in range(PASSES):
        us = {"cudnn": case.peer_us(timer, SDPBackend.CUDNN_ATTENTION),
              "flash": case.peer_us(timer, SDPBackend.FLASH_ATTENTION)}
        for name, kw in (variants.items() if i % 2 == 0 else reversed(variants.items())):
            us[name] = case.forward_us(timer, **kw)
        row["passes"].append(us)
        best = min(us["cudnn"], us["flash"])
        print(f"B{B} H{hq}/1 L{L} d{d} pass {i}: cudnn {us['cudnn']:.1f} flash {us['flash']:.1f} | "
              + ", ".join(f"{n_} [{plans[n_]}] {best / x:.3f}" if isinstance(x, float) else f"{n_} {x}"
                          for n_, x in us.items() if n_ not in ("cudnn", "flash")), flush=True)
    out.append(row)
    del case
    json.dump(out, open(sys.argv[1], "w"), indent=1)
