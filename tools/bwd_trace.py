"""Where a backward's time goes, block by block (GPU machine): the K/V kernel compiled with
-DCUFLASH_BWD_TRACE records each block's start and end (%globaltimer), SM and steps; this runs
one backward per cell and summarizes (tools/trace_stats.py).

    python3 tools/bwd_trace.py out.json [d,n,causal ...]     (default: 64,4096,1 64,4096,0 128,4096,1)

Per cell: the kernel's span; the mean time per step of the blocks by step count (a linear fit
t = a + b * steps over full-length and over short blocks: b is the step, a the block's fixed
cost); the SMs' idle time between blocks and after their last block (the grid's tail); the
last 2% of blocks to end."""
import json
import os
import sys

BLOCKS = 1 << 16
os.environ["CUFLASH_NVRTC_OPTIONS"] = (os.environ.get("CUFLASH_NVRTC_OPTIONS", "") + f" -DCUFLASH_BWD_TRACE={BLOCKS}").strip()
sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(__file__))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from trace_stats import summarize  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _build, gpu_hopper  # noqa: E402

cells = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(64, 4096, 1), (64, 4096, 0), (128, 4096, 1)]
out = []
for d, n, causal in cells:
    h, b = 2048 // d, 16384 // n
    rs = cp.random.RandomState(0)
    q, k, v, do = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    o, lse = cuflash.attention(q, k, v, causal=bool(causal), return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse, causal=bool(causal))  # compiles everything
    spec = gpu_hopper.backward_kv_spec(np.dtype(np.float16), d, bool(causal), False)[0]
    trace = cp.ndarray((BLOCKS, 4), cp.uint64, _build.get_module(spec).get_global("cuflash_bwd_trace"))
    trace.fill(0)
    cp.cuda.Device().synchronize()
    cuflash.attention_backward(do, q, k, v, o, lse, causal=bool(causal))
    cp.cuda.Device().synchronize()
    row = summarize(cp.asnumpy(trace), f"CELL {d} {n} {causal}", "step")
    if row:
        out.append({"d": d, "n": n, "causal": causal, "kernel": spec.expression, **row})
json.dump(out, open(sys.argv[1], "w"), indent=1)
