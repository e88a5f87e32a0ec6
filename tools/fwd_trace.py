"""Where a forward's time goes, block by block (GPU machine): the wgmma forward compiled with
-DCUFLASH_FWD_TRACE records each block's (persistent kernel: each query tile's) start and end
(%globaltimer), SM and key tiles; this runs one forward per cell and summarizes
(tools/trace_stats.py), as tools/bwd_trace.py does for the backward.

    python3 tools/fwd_trace.py out.json [d,n,causal ...]     (default: 64,1024,1 64,2048,1 64,4096,1 128,1024,0)

Shapes: 16k tokens x hidden 2048 (the benchmark's), fp16; the kernel and tile the dispatch picks
(gpu_hopper.default_tile: short sequences run the persistent kernel, whose rows are per tile, so
its "fixed cost" is what a tile costs beyond its key tiles and "idle between" is ~0)."""
import json
import os
import sys

ENTRIES = 1 << 17
os.environ["CUFLASH_NVRTC_OPTIONS"] = (os.environ.get("CUFLASH_NVRTC_OPTIONS", "") + f" -DCUFLASH_FWD_TRACE={ENTRIES}").strip()
sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(__file__))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from trace_stats import summarize  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _build, gpu_hopper, masks  # noqa: E402

cells = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(64, 1024, 1), (64, 2048, 1), (64, 4096, 1), (128, 1024, 0)]
out = []
for d, n, causal in cells:
    h, b = 2048 // d, 16384 // n
    rs = cp.random.RandomState(0)
    q, k, v = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    cuflash.attention(q, k, v, causal=bool(causal))  # compiles it
    tile = gpu_hopper.default_tile(d, masks.normalize_causal(bool(causal)), n, n)
    spec = gpu_hopper.forward_spec(np.dtype(np.float16), d, bool(causal), tile)[0]
    trace = cp.ndarray((ENTRIES, 4), cp.uint64, _build.get_module(spec).get_global("cuflash_fwd_trace"))
    trace.fill(0)
    cp.cuda.Device().synchronize()
    cuflash.attention(q, k, v, causal=bool(causal))
    cp.cuda.Device().synchronize()
    row = summarize(cp.asnumpy(trace), f"CELL {d} {n} {causal} {spec.short_name}", "key_tile")
    if row:
        out.append({"d": d, "n": n, "causal": causal, "kernel": spec.expression, **row})
json.dump(out, open(sys.argv[1], "w"), indent=1)
