"""Time the backward's K/V kernel alone, with and without its dQ part, on the GPU.

    python3 tools/bwd_kv_probe.py      (bf16, B*N = 16k tokens, H*d = 2048)

For each shape: the whole backward (atomic dQ), and the K/V kernel launched as the atomic-dQ
and the dK/dV-only (deterministic mode's) instantiations, CUDA-event medians. The difference
is what dQ = dS K and its atomics cost inside the kernel.
"""
import os
import statistics

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash import _problem, gpu_hopper, schedule
from cuflash._build import get_function


def timed(fn, reps=20):
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


rng = np.random.default_rng(0)
for d in (64, 128):
    for n in (4096, 16384):
        h, bsz = 2048 // d, 16384 // n
        q, k, v, do = (cp.asarray(rng.standard_normal((bsz, h, n, d)).astype(ml_dtypes.bfloat16)) for _ in range(4))
        for causal in (False, True):
            o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            total = timed(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))
            p = _problem.validate_forward(q, k, v, causal=causal)
            dsum = cp.zeros((bsz, h, n), cp.float32)
            acc = cp.zeros((bsz, h, n, d), cp.float32)
            dk, dv = cp.empty_like(k), cp.empty_like(v)
            st = lambda a: [np.int64(s // a.itemsize) for s in a.strides[:3]]
            line = [f"d={d} N={n} causal={causal}: backward {total:.3f} ms"]
            tiles = [None] + ([schedule.HopperBwdTile(64, 2, "64-query steps, dQ split by keys")] if d == 64 else [])
            for tile, det in [(tl, dt) for tl in tiles for dt in (False, True)]:
                spec, t = gpu_hopper.backward_kv_spec(p.dtype, d, causal, det, tile)
                fn = get_function(spec)
                args = (q, k, v, do, lse, dsum, acc, dk, dv, *st(q), *st(k), *st(v), *st(do), *st(dk), *st(dv),
                        np.int32(h), np.int32(n), np.int32(n), np.int32(d), np.int32(1), np.int32(0),
                        np.float32(d ** -0.5 * 1.4426950408889634))
                ms = timed(lambda: fn((-(-n // t.block_n), h, bsz), (spec.threads,), args, shared_mem=spec.smem_bytes))
                line.append(f"kv[{t.block_m}q] {'dK/dV only' if det else 'with dQ'} {ms:.3f} ms")
            flops = 10 * n * n * d * h * bsz * (0.5 if causal else 1)
            line.append(f"({flops / total / 1e9:.0f} TFLOP/s whole)")
            print("  ".join(line), flush=True)
