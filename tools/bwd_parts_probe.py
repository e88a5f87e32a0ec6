"""Where one backward call's GPU time goes, cuflash next to cuDNN: every GPU activity (kernels and
memsets, CUPTI through torch.profiler) of one call after warm-up, with its start, duration and the
idle gap before it.

    python3 tools/bwd_parts_probe.py [d,n,causal ...]    e.g. 128,1024,0 128,4096,0 64,1024,0
"""
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import cuflash


def timeline(fn, label):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    # a GPU spin first, so that the call's launches queue behind it and its GPU timeline shows
    # the gaps the GPU itself leaves (as the benchmark's timing does)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(2_000_000)
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    events = [e for e in events if "sleep" not in e.name.lower() and "spin" not in e.name.lower()]
    if not events:
        print(f"{label}: no GPU events")
        return
    t0, prev_end, busy = events[0].time_range.start, None, 0.0
    print(f"== {label}")
    for e in events:
        s, t = e.time_range.start, e.time_range.end
        gap = 0.0 if prev_end is None else s - prev_end
        busy += t - s
        print(f"   +{s - t0:8.1f} us  {t - s:8.1f} us  gap {gap:6.1f}  {e.name[:90]}")
        prev_end = t
    print(f"   span {prev_end - t0:.1f} us, busy {busy:.1f} us")


def main(cells):
    for cell in cells:
        d, n, causal = (int(x) for x in cell.split(","))
        b, h = 16384 // n, 2048 // d
        tq, tk, tv, tdo = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qq, kk, vv = (x.clone().requires_grad_() for x in (tq, tk, tv))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=bool(causal))
        q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
        o, lse = cuflash.attention(q, k, v, causal=bool(causal), return_lse=True)
        timeline(lambda: torch.autograd.grad(out, (qq, kk, vv), tdo, retain_graph=True),
                 f"cuDNN bwd d={d} N={n} causal={causal}")
        timeline(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=bool(causal)),
                 f"cuflash bwd d={d} N={n} causal={causal}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["128,1024,0", "128,4096,0", "64,1024,0"])
