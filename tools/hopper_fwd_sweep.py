"""Time wgmma forward tiles (warp-specialized or not) on the GPU, each checked first.

    python3 tools/hopper_fwd_sweep.py        (bf16, 16k tokens, hidden 2048)

Every tile is first compared with the float64 reference on small causal and non-causal inputs by
the naive-error rule; a failing tile is reported and not timed.
"""
import statistics
import sys

import cupy as cp
import ml_dtypes
import numpy as np

from cuflash import _problem, gpu_hopper
from cuflash._layout import to_bhsd
from cuflash.schedule import HopperTile
from cuflash.testing import assert_forward_within_naive_error

CANDIDATES = {
    64: [HopperTile(128, 3, 3, "table"), HopperTile(128, 2, 3, "ws", True), HopperTile(128, 2, 4, "ws", True),
         HopperTile(192, 2, 2, "ws", True)],
    128: [HopperTile(128, 2, 3, "table"), HopperTile(128, 2, 2, "ws", True), HopperTile(128, 2, 3, "ws", True),
          HopperTile(160, 2, 2, "ws", True)],
    256: [HopperTile(64, 2, 2, "table"), HopperTile(64, 2, 2, "ws", True)],
}


def run(q, k, v, causal, tile):
    p = _problem.validate_forward(q, k, v, causal=causal)
    o = cp.empty(q.shape, q.dtype)
    lse = cp.empty((p.batch, p.hq, p.nq), cp.float32)
    gpu_hopper.forward(p, to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk),
                       to_bhsd(o, p, p.hq, p.nq), lse, tile=tile)
    return o, lse


def name(t):
    return f"{t.block_m}x{t.block_n}wg{t.warpgroups}s{t.stages}{'P' if t.producer else ''}"


rng = np.random.default_rng(0)
flush = cp.empty(256 << 20, cp.uint8)
bad = 0
for d, tiles in CANDIDATES.items():
    ok = []
    for t in tiles:
        try:
            for causal in (False, True):
                q, k, v = (rng.standard_normal((1, 2, n, d)).astype(ml_dtypes.bfloat16) for n in (333, 300, 300))
                o, lse = run(*(cp.asarray(a) for a in (q, k, v)), causal, t)
                assert_forward_within_naive_error(cp.asnumpy(o), cp.asnumpy(lse), q, k, v, causal=causal)
            ok.append(t)
        except Exception as exc:  # noqa: BLE001 - reported, not timed
            bad += 1
            print(f"d={d} {name(t)}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    for n in (1024, 4096, 16384):
        h, b = 2048 // d, 16384 // n
        q, k, v = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(ml_dtypes.bfloat16)) for _ in range(3))
        for causal in (False, True):
            line = [f"d={d:3d} N={n:5d} causal={causal!s:5}"]
            for t in ok:
                run(q, k, v, causal, t)
                times = []
                for _ in range(15):
                    flush.fill(1)
                    a, e = cp.cuda.Event(), cp.cuda.Event()
                    a.record()
                    run(q, k, v, causal, t)
                    e.record()
                    e.synchronize()
                    times.append(cp.cuda.get_elapsed_time(a, e))
                ms = statistics.median(times)
                tf = 4 * n * n * d * h * b * (0.5 if causal else 1) / ms / 1e9
                line.append(f"{name(t)} {ms:.3f} ms {tf:.0f} TF")
            print("  ".join(line), flush=True)
sys.exit(1 if bad else 0)
