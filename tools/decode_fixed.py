"""Where the small decode cells lose: time vs cache length at a fixed grid (B=8, Hkv=8, Hq=32,
d=128, 5 splits), with and without the L2/TLB flush, cuflash and cuDNN.   python tools/decode_fixed.py
SPLITS=5,1,2,10 (split counts); CLUSTER=1 (with SPLITS from 2, 4, 8) / 0 forces the merge in a cluster /
the combine kernel (unset: the planner's choice, a cluster for 2, 4 or 8 splits)."""
import sys

sys.path.insert(0, ".")
import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.peers import Timer
from cuflash import gpu_decode, schedule
from cuflash._problem import validate_forward
from decode_cells import decode_inputs  # tools/, this script's folder

flushed = Timer(warmup=3, repeats=40, seconds_per_impl=0.3)
warm = Timer(warmup=3, repeats=40, seconds_per_impl=0.3)
warm.flush = lambda: warm.spin(warm.SPIN_CYCLES) if warm.spin else None
tile = schedule.DecodeTile(16, 4, 2, 2, "fixed")
import os
cluster = {"1": True, "0": False}.get(os.environ.get("CLUSTER", ""))
for splits in [int(x) for x in os.environ.get("SPLITS", "5,1,2,10").split(",")]:
    for L in (1024, 2048, 4096, 8192, 16384):
        B, hq, hkv, d = 8, 32, 8, 128
        q, k, v, _ = decode_inputs(L, B, hkv, hq, d)
        qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
        p = validate_forward(qc, kc, vc)
        o4 = cp.empty_like(qc)
        lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
        f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, tile=tile, splits=splits, cluster=cluster)
        g = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        out = []
        for timer in (flushed, warm):
            out.append(timer(f)[0] * 1e3)
            if splits == 5:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out.append(timer(g)[0] * 1e3)
        merge = "cluster" if gpu_decode.launch_plan(p, 132, splits, tile, cluster=cluster).cluster else "combine"
        print(f"splits={splits} {merge} L={L:6d} MB={2 * B * hkv * L * d * 2 / 1e6:6.1f} us: cuflash flushed/warm, cudnn flushed/warm:",
              " ".join(f"{x:7.1f}" for x in out), flush=True)
