"""Does the backward pay for a last partial wave? (GPU machine) Time cuflash's and cuDNN's backward
per head over head counts around whole waves of one block per SM (the warp-specialized K/V kernel:
N / 128 key-tile blocks per head at d=64 and d=128), B=1, full attention; same process, L2 flushed.

    python3 tools/bwd_waves_probe.py [--d 64] [--n 4096] [--heads 123,124,128,132]
"""
import argparse
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, default=64)
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--heads", default="123,124,128,132")
args = ap.parse_args()
timer = Timer(warmup=2, repeats=10, seconds_per_impl=1.0)
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
for h in (int(x) for x in args.heads.split(",")):
    q, k, v, do = (torch.randn(1, h, args.n, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv)
    cudnn_ms, _ = timer(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True))
    qc, kc, vc, doc = (cp.from_dlpack(x) for x in (q, k, v, do))
    o, lse = cuflash.attention(qc, kc, vc, return_lse=True)
    ms, _ = timer(lambda: cuflash.attention_backward(doc, qc, kc, vc, o, lse))
    blocks = h * args.n // 128
    print(f"BWDWAVES d={args.d} N={args.n} H={h} blocks={blocks} waves={blocks / sms:.2f}  cuflash {ms:.3f} ms "
          f"({ms / h * 1e3:.2f} us/head)  cuDNN {cudnn_ms:.3f} ms ({cudnn_ms / h * 1e3:.2f} us/head)  x{cudnn_ms / ms:.3f}",
          flush=True)
    del q, k, v, do, qq, kk, vv, out, qc, kc, vc, doc, o, lse
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
