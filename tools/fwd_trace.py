"""Where a forward's time goes, block by block (GPU machine): the wgmma forward compiled with
-DCUFLASH_FWD_TRACE records each block's (persistent kernel: each query tile's) start and end
(%globaltimer), SM and key tiles; this runs one forward per cell and summarizes
(tools/trace_stats.py), as tools/bwd_trace.py does for the backward.

    python3 tools/fwd_trace.py out.json [d,n,causal ...]     (default: 64,1024,1 64,2048,1 64,4096,1 128,1024,0)

Shapes: 16k tokens x hidden 2048 (the benchmark's), fp16; the kernel and tile the dispatch picks
(gpu_hopper.default_tile: short sequences run the persistent kernel, whose rows are per tile, so
its "fixed cost" is what a tile costs beyond its key tiles and "idle between" is ~0), or the tile
FWD_TRACE_TILE names (block_n,warpgroups,stages,kind[,wg_epilogue] as hopper_fwd_sweep.T takes).
Each block's or tile's time is also split into its start (until Q and K_0 landed), its loop and
its epilogue."""
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



def phases(rows):
    """Per key-tile count: mean start (until Q and K_0 landed), loop (until the last P V retired)
    and epilogue (O and LSE stored) of a block or tile, in us."""
    t = rows[rows[:, 1] > 0].astype(np.int64)
    out = {}
    for w in np.unique(t[:, 3]):
        s = t[t[:, 3] == w]
        start, loop, epi = ((s[:, 4] - s[:, 0]).mean() / 1e3, (s[:, 5] - s[:, 4]).mean() / 1e3,
                            (s[:, 1] - s[:, 5]).mean() / 1e3)
        out[int(w)] = {"start": float(start), "loop": float(loop), "epilogue": float(epi)}
    for w in sorted(out)[:2] + sorted(out)[-2:]:
        print(f"   phases key_tiles {w}: start {out[w]['start']:.2f} us, loop {out[w]['loop']:.2f} us "
              f"({out[w]['loop'] / max(w, 1):.3f}/key tile), epilogue {out[w]['epilogue']:.2f} us", flush=True)
    return out


cells = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(64, 1024, 1), (64, 2048, 1), (64, 4096, 1), (128, 1024, 0)]
FORCED = os.environ.get("FWD_TRACE_TILE")
out = []
for d, n, causal in cells:
    h, b = 2048 // d, 16384 // n
    rs = cp.random.RandomState(0)
    q, k, v = (rs.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    if FORCED:  # FWD_TRACE_TILE=block_n,warpgroups,stages,kind[,wg_epilogue] (hopper_fwd_sweep.T)
        from hopper_fwd_sweep import T, run
        bn, wg, st, kind, *epi = FORCED.split(",")
        tile = T(int(bn), int(wg), int(st), kind, bool(int(epi[0])) if epi else False)
        attend = lambda: run(q, k, v, "top_left" if causal else False, tile)  # noqa: E731
    else:
        tile = gpu_hopper.default_tile(d, masks.normalize_causal(bool(causal)), n, n)
        attend = lambda: cuflash.attention(q, k, v, causal=bool(causal))  # noqa: E731
    attend()  # compiles it
    spec = gpu_hopper.forward_spec(np.dtype(np.float16), d, bool(causal), tile)[0]
    trace = cp.ndarray((ENTRIES, 6), cp.uint64, _build.get_module(spec).get_global("cuflash_fwd_trace"))
    trace.fill(0)
    cp.cuda.Device().synchronize()
    attend()
    cp.cuda.Device().synchronize()
    rows = cp.asnumpy(trace)
    row = summarize(rows[:, :4], f"CELL {d} {n} {causal} {spec.short_name}", "key_tile")
    if row:
        row["phases_us"] = phases(rows)
        out.append({"d": d, "n": n, "causal": causal, "kernel": spec.expression, **row})
json.dump(out, open(sys.argv[1], "w"), indent=1)
