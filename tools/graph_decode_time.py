"""Decode steps per second: direct cuflash.attention calls vs replays of a CUDA graph that
captured one call (CuPy stream capture, MemoryAsyncPool), back to back on one stream, next to
torch SDPA (cuDNN) calls; B=8, Hq=32, Hkv=8, L=4096, d=128, fp16 (the small decode cell).
    python3 tools/graph_decode_time.py [steps]"""
import sys
import time

import cupy as cp
import numpy as np
import torch

import cuflash

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
rng = np.random.default_rng(0)
b, hq, hkv, n, d = 8, 32, 8, 4096, 128
q = cp.asarray(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
k, v = (cp.asarray(rng.standard_normal((b, hkv, n, d)).astype(np.float16)) for _ in range(2))
out = cp.empty_like(q)
stream = cp.cuda.Stream(non_blocking=True)


def rate(fn):
    with stream:
        for _ in range(20):
            fn()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        stream.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


direct = rate(lambda: cuflash.attention(q, k, v, out=out, validate=False))
with stream:
    stream.begin_capture()
    cuflash.attention(q, k, v, out=out, validate=False)
    graph = stream.end_capture()
replay = rate(lambda: graph.launch(stream))
tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k.repeat(4, axis=1), v.repeat(4, axis=1)))
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

ts = torch.cuda.ExternalStream(stream.ptr)
with torch.cuda.stream(ts), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    cudnn = rate(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))
print(f"decode B={b} Hq={hq} Hkv={hkv} L={n} d={d} fp16, us per step back to back: cuflash direct {direct:.1f}, "
      f"cuflash graph replay {replay:.1f}, torch SDPA cuDNN direct {cudnn:.1f}")
