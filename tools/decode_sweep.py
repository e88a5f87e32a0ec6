"""Decode tile/split sweep against torch cuDNN/flash on the peers' decode grid (GPU machine)."""
import json
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cuflash import gpu_decode, schedule
from cuflash._problem import validate_forward

out = []
cands = [(32, 4, 2), (16, 4, 2), (16, 8, 2), (16, 4, 3), (32, 4, 3), (64, 2, 2), (16, 8, 3)]
for L, B, hkv in [(4096, 8, 8), (16384, 8, 8), (16384, 64, 8), (16384, 8, 32), (65536, 8, 8)]:
    hq, d = 32, 128
    q = torch.randn(B, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nbytes = 2 * B * hkv * L * d * 2 + 2 * B * hq * d * 2
    row = {"L": L, "B": B, "hkv": hkv, "tbps": {}}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), warmup=10, rep=50, return_mode="median")
    row["tbps"]["cudnn"] = nbytes / ms / 1e9
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
    for bn, w, st in cands:
        t = schedule.DecodeTile(bn, w, st, 2, "sweep")
        for waves in (1, 2, 4, 8):
            key = f"{bn}x{w}s{st}v{waves}"
            try:
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, tile=t, waves=waves)
                f()
                cp.cuda.Device().synchronize()
                ms = do_bench(f, warmup=10, rep=50, return_mode="median")
                row["tbps"][key] = nbytes / ms / 1e9
            except Exception as e:
                row["tbps"][key] = repr(e)[:80]
    best = sorted(((v_, k_) for k_, v_ in row["tbps"].items() if isinstance(v_, float)), reverse=True)[:6]
    print("DECODE", L, B, hkv, [(k_, round(v_, 2)) for v_, k_ in best], flush=True)
    out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
