"""Where a split-KV decode's time goes, block by block (GPU machine): the decode kernels compiled
with -DCUFLASH_DECODE_TRACE record each block's start, end, SM, warp 0's key tiles, when Q was
in registers, when warp 0 left its loop, and (split-KV kernel) when the block's warps had merged
and its result was stored. Per cell (d=128 bf16 Hq=32, the peers' decode grid)
and variant (the planner's choice, cluster merges of 2-8 splits, the combine kernel at 3-8
splits), this times the variant next to cuDNN (benchmarks.peers.Timer: L2 flushed, launch hidden)
and summarizes one traced launch after an L2 flush:

  span (first start to last end) and the cache bytes over it; blocks per SM (most / fewest, and
  how many ran at once); SMs' busy share of the span (union of their blocks' intervals); block
  time p10 / p50 / p90 / max and its start (until Q is in registers), loop and end (the warps'
  merge, the store, the rest) medians; when 50 / 90 / 100% of blocks had ended.

    python3 tools/decode_trace.py out.json [--split-cells | --many-cells | --cells L,B,Hkv[,Hq];...] [--variants api,cluster4,combine6]
(variants wideN / longN: the wide-rows tile, ring 3 / ring 4, at N splits)
"""
import json
import os
import sys

BLOCKS = 1 << 14
os.environ["CUFLASH_NVRTC_OPTIONS"] = (os.environ.get("CUFLASH_NVRTC_OPTIONS", "") + f" -DCUFLASH_DECODE_TRACE={BLOCKS}").strip()
sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import _build, gpu_decode  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

gpu_decode.CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8)  # the kernel takes any size up to 8; the library instantiates 2, 4, 8
from decode_cells import CELLS, decode_inputs  # noqa: E402  # the peers' decode grid (tools/, this script's folder)
if "--split-cells" in sys.argv:
    CELLS = [c for c in CELLS if c[1] * c[2] < 132]
if "--many-cells" in sys.argv:
    CELLS = [c for c in CELLS if c[1] * c[2] >= 132]
if "--cells" in sys.argv:  # cells outside the grid, e.g. "8192,1,8;32768,1,8"
    CELLS = [tuple(int(x) for x in c.split(",")) for c in sys.argv[sys.argv.index("--cells") + 1].split(";")]
VARIANTS = ["api"] + [f"cluster{s}" for s in (2, 3, 4, 5, 6, 7, 8)] + [f"combine{s}" for s in (3, 4, 5, 6, 8)]
if "--variants" in sys.argv:
    VARIANTS = sys.argv[sys.argv.index("--variants") + 1].split(",")

launched = []  # the spec of every decode launch, so the trace is read from the module that ran
_get_function = gpu_decode.get_function


def _recording_get_function(spec):
    launched.append(spec)
    return _get_function(spec)


gpu_decode.get_function = _recording_get_function


def busy_share(start, end, sm):
    """Mean over SMs of the share of the span in which at least one of the SM's blocks ran, and
    the most blocks one SM ran at once."""
    span = end.max() - start.min()
    shares, most = [], 0
    for s in np.unique(sm):
        st, en = start[sm == s], end[sm == s]
        ev = sorted([(t, 1) for t in st] + [(t, -1) for t in en], key=lambda x: (x[0], x[1]))
        live, busy, last, peak = 0, 0.0, None, 0
        for t, step in ev:
            if live > 0:
                busy += t - last
            live += step
            peak = max(peak, live)
            last = t
        shares.append(busy / span)
        most = max(most, peak)
    return float(np.mean(shares)), float(np.min(shares)), most


def summarize(rows, nbytes, label):
    t = rows[rows[:, 1] > 0].astype(np.float64)
    if not len(t):
        print(label, "no trace rows", flush=True)
        return {}
    t0 = t[:, 0].min()
    start, end, sm = (t[:, 0] - t0) / 1e3, (t[:, 1] - t0) / 1e3, t[:, 2].astype(int)
    ready, loop = (t[:, 4] - t0) / 1e3, (t[:, 5] - t0) / 1e3
    dur = end - start
    span = float(end.max())
    merged, stored = (t[:, 6] - t0) / 1e3, (t[:, 7] - t0) / 1e3  # (0 in a cluster kernel: no such points)
    per_sm = np.bincount(sm)
    per_sm = per_sm[per_sm > 0]
    share, share_min, most = busy_share(start, end, sm)
    q = lambda x, p: float(np.percentile(x, p))  # noqa: E731
    out = {"blocks": len(t), "sms": int(len(per_sm)), "span_us": span, "tbps_span": nbytes / span / 1e6,
           "blocks_per_sm_max": int(per_sm.max()), "blocks_per_sm_min": int(per_sm.min()),
           "blocks_at_once_max": most, "sm_busy_mean": share, "sm_busy_min": share_min,
           "block_us": [q(dur, 10), q(dur, 50), q(dur, 90), float(dur.max())],
           "start_us_p50": q(ready - start, 50), "loop_us_p50": q(loop - ready, 50), "end_us_p50": q(end - loop, 50),
           "first_start_last_us": float(start.max()), "ended_50_90_100_us": [q(end, 50), q(end, 90), span],
           "tiles_warp0": [int(t[:, 3].min()), int(t[:, 3].max())]}
    print(label, f"span {span:.1f} us ({out['tbps_span']:.2f} TB/s), {len(t)} blocks on {len(per_sm)} SMs "
          f"({per_sm.min()}-{per_sm.max()} each, {most} at once); SM busy {100 * share:.0f}% (min {100 * share_min:.0f}%); "
          f"block p10/50/90/max {out['block_us'][0]:.1f}/{out['block_us'][1]:.1f}/{out['block_us'][2]:.1f}/{out['block_us'][3]:.1f} us "
          f"= start {out['start_us_p50']:.1f} + loop {out['loop_us_p50']:.1f} + end {out['end_us_p50']:.1f}; "
          + (f"(end: warps merged {q(merged - loop, 50):.1f}, stored {q(stored - merged, 50):.1f}, rest {q(end - stored, 50):.1f}); "
             if t[:, 7].min() > 0 else "")
          + f"last start {out['first_start_last_us']:.1f}; ended 50/90/100% {out['ended_50_90_100_us'][0]:.1f}/"
          f"{out['ended_50_90_100_us'][1]:.1f}/{span:.1f}", flush=True)
    return out


def variant_kwargs(name):
    if name == "api":
        return {}
    if name.startswith("cluster"):
        return {"splits": int(name[7:]), "cluster": True}
    if name.startswith("combine"):
        return {"splits": int(name[7:]), "cluster": False}
    if name.startswith("wide") or name.startswith("long"):  # the wide-rows tile (ring 3 / ring 4) at N splits
        from cuflash import schedule
        table = schedule.DECODE_TILES_WIDE_ROWS if name.startswith("wide") else schedule.DECODE_TILES_WIDE_ROWS_LONG
        return {"splits": int(name[4:]), "tile": table[128]}
    raise SystemExit(f"unknown variant {name!r}")


timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
out = []
for L, B, hkv, *hq_ in CELLS:  # a fourth value: Hq (default 32)
    hq, d = (hq_[0] if hq_ else 32), 128
    q, k, v, nbytes = decode_inputs(L, B, hkv, hq, d)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        cudnn_ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    print(f"CELL L={L} B={B} Hq={hq} Hkv={hkv}: cuDNN {cudnn_ms * 1e3:.1f} us ({nbytes / cudnn_ms / 1e9:.2f} TB/s)", flush=True)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
    for name in VARIANTS:
        row = {"L": L, "B": B, "hkv": hkv, "variant": name, "cudnn_us": cudnn_ms * 1e3}
        try:
            kw = variant_kwargs(name)
            f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, **kw)  # noqa: E731
            o4.fill(float("nan"))
            f()
            row["max_err_vs_cudnn"] = float(cp.abs(o4.astype(cp.float32) - cp.from_dlpack(ref).astype(cp.float32)).max())
            ms, _ = timer(f)
            row["us"], row["x_cudnn"] = ms * 1e3, cudnn_ms / ms
            launched.clear()
            f()
            spec = launched[0]
            lp = gpu_decode.launch_plan(p, cp.cuda.Device().attributes["MultiProcessorCount"], **{k_: v_ for k_, v_ in kw.items()})
            row["plan"] = {"splits": lp.splits, "cluster": lp.cluster, "chunk": lp.chunk, "tile": [lp.tile.block_n, lp.tile.warps, lp.tile.stages]}
            trace = cp.ndarray((BLOCKS, 8), cp.uint64, _build.get_module(spec).get_global("cuflash_decode_trace"))
            trace.fill(0)
            if not os.environ.get("TRACE_WARM"):  # (TRACE_WARM=1: the traced launch finds the cache and the code in L2)
                timer.flush()
            if os.environ.get("TRACE_REPEAT"):  # (TRACE_REPEAT=1: the same launch right before the traced one, nothing
                f()                             # between them; every block rewrites its row)
            f()
            cp.cuda.Device().synchronize()
            print(f"  {name:10s} {row['us']:6.1f} us x{row['x_cudnn']:.3f} err {row['max_err_vs_cudnn']:.3g} plan {row['plan']}", flush=True)
            raw = cp.asnumpy(trace)
            row["trace"] = summarize(raw, nbytes, "    trace")
            if os.environ.get("TRACE_RAW"):  # every block's row, for a timeline (np.load)
                np.save(os.path.join(os.environ["TRACE_RAW"], f"trace_{L}_{B}_{hkv}_{name}.npy"), raw[raw[:, 1] > 0])
        except Exception as e:  # noqa: BLE001 - one variant failing must not end the probe
            row["error"] = repr(e)[:300]
            print(f"  {name:10s} error {row['error']}", flush=True)
        out.append(row)
    del q, k, v, qc, kc, vc, ref
    json.dump(out, open(sys.argv[1], "w"), indent=1)
