"""Smallest forward launch, for compute-sanitizer / ncu runs: python3 tools/tiny_fwd.py B H N d [dtype] [causal] [ws|tma|pp|persist|pppersist]

ws / tma / pp: the warp-specialized cp.async tile / the TMA table tile / its ping-pong
variant, for this head dim (default: what the dispatch picks); persist / pppersist: the table
tile's persistent kernel (own pace / ping-pong) on 3 blocks, so each walks several tiles."""
import dataclasses
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash import gpu_decode, gpu_hopper, schedule

b, h, n, d = (int(x) for x in sys.argv[1:5])
dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[sys.argv[5] if len(sys.argv) > 5 else "bf16"]
causal = (sys.argv[6] if len(sys.argv) > 6 else "false") != "false"
if len(sys.argv) > 7 and sys.argv[7] in ("ws", "tma", "pp", "persist", "pppersist"):
    hd = schedule.head_dim_bucket(d)
    t = schedule.HOPPER_FORWARD_TILES[hd]  # the TMA table tile
    if sys.argv[7] == "ws":
        t = gpu_hopper.warp_specialized(gpu_hopper.cp_async_tile(d))
    elif sys.argv[7] == "pp":
        t = dataclasses.replace(t, pingpong=True)
    elif sys.argv[7] in ("persist", "pppersist"):
        t = dataclasses.replace(t, persistent=True, pingpong=sys.argv[7] == "pppersist")
        gpu_decode._sm_count = lambda device_id: 3  # (gpu_hopper.forward reads it at call time)
    schedule.HOPPER_FORWARD_TILES[hd] = t
rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(dtype)) for _ in range(3))
o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
cp.cuda.Device().synchronize()
print("ok", float(cp.abs(o.astype(cp.float32)).max()), float(lse.max()))
