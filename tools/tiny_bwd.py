"""Smallest backward launch, for compute-sanitizer / ncu runs: python3 tools/tiny_bwd.py B H N d [bf16|fp16|fp32] [causal] [tma|ws|wsp [blocks]]

tma: the Hopper backward table tile with Q/dO fetched by TMA; ws: its warp-specialized kernel; wsp: the persistent one."""
import dataclasses
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash import gpu_hopper, schedule

b, h, n, d = (int(x) for x in sys.argv[1:5])
dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}[sys.argv[5] if len(sys.argv) > 5 else "bf16"]
causal = (sys.argv[6] if len(sys.argv) > 6 else "false") != "false"
if len(sys.argv) > 7 and sys.argv[7] in ("tma", "ws", "wsp"):
    hd = schedule.head_dim_bucket(d)
    t = gpu_hopper.backward_tma(schedule.HOPPER_BACKWARD_TILES[hd])
    schedule.HOPPER_BACKWARD_TILES[hd] = dataclasses.replace(t, ws=sys.argv[7] != "tma", persistent=sys.argv[7] == "wsp")
    if len(sys.argv) > 8:  # blocks of the persistent kernel (each then walks several units)
        from cuflash import gpu_backward

        gpu_backward._PERSISTENT_BLOCKS = int(sys.argv[8])
    schedule.HOPPER_BACKWARD_WS = {}  # the variant asked for, not the default rule
rng = np.random.default_rng(0)
q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(dtype)) for _ in range(4))
o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
cp.cuda.Device().synchronize()
print("ok", *(float(cp.abs(g.astype(cp.float32)).max()) for g in (dq, dk, dv)))
