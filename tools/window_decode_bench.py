"""Windowed decode (window=(W, 0), causal) on a contiguous and a paged cache (GPU machine): time
and the bytes of the window's keys read per second, against cuDNN (torch SDPA) over the same
window's keys sliced out of the cache (no mask needed: one token sees the window's last W + 1
keys). Run it in two snapshots to compare kernels.   python tools/window_decode_bench.py out.json"""
import json
import sys

sys.path.insert(0, ".")
import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from benchmarks.benchmarks.bench_attention import shuffled_pages
from benchmarks.peers import Timer

timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
rows = []
hq, d, W = 32, 128, 4096
for L in (16384, 65536):
    for B, hkv in ((8, 8), (64, 8)):
        rs = cp.random.RandomState(L + B)
        q = rs.standard_normal((B, hq, 1, d), dtype=cp.float32).astype(cp.float16)
        k = rs.standard_normal((B, hkv, L, d), dtype=cp.float32).astype(cp.float16)
        v = rs.standard_normal((B, hkv, L, d), dtype=cp.float32).astype(cp.float16)
        nbytes = 2 * B * hkv * (W + 1) * d * 2  # the window's K and V
        row = {"L": L, "B": B, "hkv": hkv, "window": [W, 0]}
        f = lambda: cuflash.attention(q, k, v, causal=True, window=(W, 0))
        ref = f()
        row["contiguous_ms"], _ = timer(f)
        kc, vc, table = shuffled_pages(cp, k, v, 64, seed=1)
        g = lambda: cuflash.attention(q, kc, vc, block_table=table, causal=True, window=(W, 0), validate=False)
        row["paged64_maxdiff"] = float(cp.abs(g().astype(cp.float32) - ref.astype(cp.float32)).max())
        row["paged64_ms"], _ = timer(g)
        del kc, vc
        tq, tk, tv = (torch.from_dlpack(a) for a in (q, k[:, :, L - W - 1:], v[:, :, L - W - 1:]))
        tk, tv = (x.repeat_interleave(hq // hkv, dim=1).contiguous() for x in (tk, tv))  # (cuDNN: GQA by copies)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn_sliced_ms"], _ = timer(lambda: F.scaled_dot_product_attention(tq, tk, tv))
            o_ref = F.scaled_dot_product_attention(tq, tk, tv)
        row["vs_cudnn_sliced_maxdiff"] = float((torch.from_dlpack(ref).float() - o_ref.float()).abs().max())
        for key in ("contiguous", "paged64"):
            row[f"{key}_tbps"] = nbytes / row[f"{key}_ms"] / 1e9
        print("WINDOW", L, B, hkv, " ".join(f"{k_}={v_:.4g}" for k_, v_ in row.items() if isinstance(v_, float)), flush=True)
        rows.append(row)
        del q, k, v, tq, tk, tv
json.dump(rows, open(sys.argv[1], "w"), indent=1)
