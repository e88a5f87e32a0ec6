"""Quick backward timing vs torch's flash/cudnn backward (same process, same inputs)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
import cupy as cp

import cuflash

import os

CELLS = [(64, 4096, False), (64, 4096, True), (128, 4096, False), (128, 4096, True), (128, 16384, True),
         (192, 4096, False), (192, 4096, True),
         (256, 4096, False), (256, 4096, True), (256, 16384, False), (256, 16384, True)]
ONLY_D = os.environ.get("BWD_QUICK_D")  # e.g. "256": those head dims only
for d, n, causal in CELLS:
    if ONLY_D and str(d) not in ONLY_D.split(","):
        continue
    h, b = 2048 // d, 16384 // n
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    row = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        with sdpa_kernel([be]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        ms = do_bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), warmup=10, rep=50, return_mode="median")
        row[name] = flops / ms / 1e9
    qc, kc, vc, doc = (cp.from_dlpack(x) for x in (q, k, v, do))
    o, lse = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True)
    for det in (False, True):
        ms = do_bench(lambda: cuflash.attention_backward(doc, qc, kc, vc, o, lse, causal=causal, deterministic=det), warmup=10, rep=50, return_mode="median")
        row["cuflash" + ("-det" if det else "")] = flops / ms / 1e9
    # agreement with torch flash
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    g = torch.autograd.grad(out, (qq, kk, vv), do)
    mine = cuflash.attention_backward(doc, qc, kc, vc, o, lse, causal=causal)
    diffs = [round((torch.from_dlpack(m).float() - t.float()).abs().max().item(), 4) for m, t in zip(mine, g)]
    print("BWD", d, n, causal, {k_: round(v_) for k_, v_ in row.items()}, "maxdiff dq,dk,dv vs flash", diffs, flush=True)
