"""The cluster merge's edge on the decode grid's 8/8 cells (GPU machine): B=8 Hkv=8 Hq=32 d=128,
L = 8k / 12k / 16k / 24k, where the planner merged 4 splits in a 4-block cluster up to
CLUSTER_MAX_CHUNK = 4096 keys per split (until a31f934: now up to CLUSTER4_MAX_CHUNK = 3072). A block trace at 16k put those clusters on 124 of the 132
SMs. Variants (explicit tile, split count and merge): the 4-block cluster with the ring-1 tile (the
planner's at 16k) or the table's ring-0 tile; 4 or 6 splits through memory, merged by the last
split, with the ring-0 / ring-1 / ring-2 tiles. Several passes, alternating variants, next to cuDNN
each pass (benchmarks.peers.Timer: L2 flushed, launch hidden); prints x cuDNN per variant and pass.

    python3 tools/cluster_edge_probe.py out.json [passes]
"""
import json
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, schedule  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import decode_inputs  # noqa: E402

PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 3
T0 = schedule.DECODE_TILES[128]                       # ring 0: each warp its own ring
T1 = schedule.DECODE_TILES_LONG_CLUSTER_SPLITS[128]   # ring 1: one block-wide K+V copy per step
T2 = schedule.DECODE_TILES_LONG_SPLITS[128]           # ring 2: FA2's order
VARIANTS = {  # name: forward keywords
    "cl4-r1": dict(tile=T1, splits=4, cluster=True), "cl4-r0": dict(tile=T0, splits=4, cluster=True),
    "last4-r0": dict(tile=T0, splits=4, cluster=False, merge="last"),
    "last4-r1": dict(tile=T1, splits=4, cluster=False, merge="last"),
    "last4-r2": dict(tile=T2, splits=4, cluster=False, merge="last"),
    "last6-r0": dict(tile=T0, splits=6, cluster=False, merge="last"),
    "last6-r1": dict(tile=T1, splits=6, cluster=False, merge="last"),
}
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
out = []
for L in (8192, 12288, 16384, 24576):
    q, k, v, nbytes = decode_inputs(L, 8, 8)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((8, 32, 1), dtype=cp.float32)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    refc = cp.from_dlpack(ref).astype(cp.float32)
    row = {"L": L, "passes": []}
    for i in range(PASSES):
        us = {}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            us["cudnn"] = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))[0] * 1e3
        us["api"] = timer(lambda: cuflash.attention(qc, kc, vc))[0] * 1e3
        for name, kw in (VARIANTS.items() if i % 2 == 0 else reversed(VARIANTS.items())):
            try:
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, **kw)  # noqa: E731
                o4.fill(float("nan"))
                f()
                err = float(cp.abs(o4.astype(cp.float32) - refc).max())
                us[name] = timer(f)[0] * 1e3 if err < 0.02 else f"wrong {err}"
            except Exception as e:  # noqa: BLE001 - one variant failing must not end the probe
                us[name] = repr(e)[:80]
        row["passes"].append(us)
        print(f"L={L} pass {i}: cudnn {us['cudnn']:.1f} us | " + ", ".join(
            f"{k_} {us['cudnn'] / v_:.4f}" if isinstance(v_, float) else f"{k_} {v_}"
            for k_, v_ in us.items() if k_ != "cudnn"), flush=True)
    out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
