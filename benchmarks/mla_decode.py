"""MLA decoding (DeepSeek's latent cache: q and k 576 wide, v = k[..., :512]) on attn_decode_mla:
achieved TB/s of the cache read and TFLOP/s, against the device's copy bandwidth (torch has no MLA
decode peer to time). One query token, Hkv = 1, v aliasing k.

    python benchmarks/mla_decode.py                 # on a GPU with CuPy (about 30 s)
    python benchmarks/mla_decode.py --dry-run       # the plan of each cell, anywhere

"tbps" counts the cache once (576 x 2 bytes per key: V is read from K's rows) plus q and o;
"tflops" 2 x Hq x L x (576 + 512) per sequence (Q K^T over 576, P V over 512). "copy_tbps" is a
device-to-device copy of 2 GiB (read + write bytes over time), the ceiling a cache read can reach;
"of_copy" is tbps / copy_tbps.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np

BATCHES = (1, 8, 64)
HEADS = (16, 128)
LENGTHS = (4096, 32768)
D, DV = 576, 512


def cells():
    return [(b, h, n) for b in BATCHES for h in HEADS for n in LENGTHS]


def cache_bytes(b, h, n):
    return b * n * D * 2 + b * h * (D + DV) * 2


def flops(b, h, n):
    return 2.0 * b * h * n * (D + DV)


def _time(fn, cupy, repeats=20):
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeats  # ms


def copy_tbps(cupy):
    a = cupy.empty(1 << 30, dtype=np.uint16)
    b = cupy.empty_like(a)
    ms = _time(lambda: b.__setitem__(Ellipsis, a), cupy, 10)
    return 2 * a.nbytes / (ms * 1e-3) / 1e12


def main(argv):
    if "--dry-run" in argv:
        from cuflash.plan import decode_mla

        for b, h, n in cells():
            p = SimpleNamespace(batch=b, hq=h, hkv=1, nq=1, nk=n, d=D, dv=DV, group=h)
            print(json.dumps({"B": b, "Hq": h, "L": n, "plan": decode_mla.launch_plan(p, 132)._asdict()}, default=str))
        return 0
    import cupy

    import cuflash
    from cuflash.core.arrays import BFLOAT16

    ceiling = copy_tbps(cupy)
    rng = np.random.default_rng(0)
    for b, h, n in cells():
        q = cupy.asarray(rng.standard_normal((b, h, 1, D), dtype=np.float32)).astype(np.float16).view(np.uint16).view(BFLOAT16)
        cache = cupy.empty((b, 1, n, D), dtype=BFLOAT16)
        cache.view(np.uint16)[...] = q.view(np.uint16)[:, :1, :1, :]  # (any finite values)
        out = cupy.empty((b, h, 1, DV), dtype=BFLOAT16)
        ms = _time(lambda: cuflash.attention(q, cache, cache[..., :DV], scale=0.1, out=out), cupy)
        tbps = cache_bytes(b, h, n) / (ms * 1e-3) / 1e12
        print(json.dumps({"B": b, "Hq": h, "L": n, "ms": round(ms, 4), "tbps": round(tbps, 3),
                          "tflops": round(flops(b, h, n) / (ms * 1e-3) / 1e12, 1), "copy_tbps": round(ceiling, 3),
                          "of_copy": round(tbps / ceiling, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
