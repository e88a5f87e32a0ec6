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
import cupy as cp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import decode_inputs  # noqa: E402

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
    q, k, v, nbytes = decode_inputs(L, B, 1, hq, d)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        refc = cp.from_dlpack(F.scaled_dot_product_attention(q, k, v, enable_gqa=True)).astype(cp.float32)
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
        us = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel([be]):
                us[name] = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))[0] * 1e3
        for name, kw in (variants.items() if i % 2 == 0 else reversed(variants.items())):
            try:
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, **kw)  # noqa: E731
                o4.fill(float("nan"))
                f()
                err = float(cp.abs(o4.astype(cp.float32) - refc).max())
                us[name] = timer(f)[0] * 1e3 if err < 0.02 else f"wrong {err}"
            except Exception as e:  # noqa: BLE001 - one variant failing must not end the probe
                us[name] = repr(e)[:60]
        row["passes"].append(us)
        best = min(us["cudnn"], us["flash"])
        print(f"B{B} H{hq}/1 L{L} d{d} pass {i}: cudnn {us['cudnn']:.1f} flash {us['flash']:.1f} | "
              + ", ".join(f"{n_} [{plans[n_]}] {best / x:.3f}" if isinstance(x, float) else f"{n_} {x}"
                          for n_, x in us.items() if n_ not in ("cudnn", "flash")), flush=True)
    out.append(row)
    del q, k, v, qc, kc, vc, refc
    json.dump(out, open(sys.argv[1], "w"), indent=1)
