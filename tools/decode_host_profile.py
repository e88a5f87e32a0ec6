"""Host time of one decode call (cuflash.attention, Nq=1) next to torch SDPA (cuDNN), and where
cuflash's goes (cProfile, top functions by own time):

    python3 tools/decode_host_profile.py [--calls 300] [--out profile.txt]

Host time = wall time of `calls` back-to-back calls without a sync, divided by `calls`, after a
GPU spin long enough that the queue never drains (so launches never wait on the GPU).
"""
import argparse
import cProfile
import io
import pstats
import time

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash


def spin(ms):  # keep the GPU busy so that the host never waits for queue space
    torch.cuda._sleep(int(ms * 1.9e6))


def host_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    spin(2 * calls * 0.5)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = []
    for b, hkv, nk in ((8, 8, 4096), (64, 8, 16384)):
        tq = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        tk, tv = (torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))
        lens = cp.full((b,), nk, dtype=cp.int32)
        cases = {
            "cuflash": lambda: cuflash.attention(q, k, v),
            "cuflash kv_lens validate=False": lambda: cuflash.attention(q, k, v, kv_lens=lens, validate=False),
        }
        tk4, tv4 = (x.repeat_interleave(32 // hkv, dim=1) for x in (tk, tv))

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(tq, tk4, tv4)
        cases["torch-cudnn"] = sdpa
        for name, fn in cases.items():
            lines.append(f"B={b} Hkv={hkv} L={nk} {name}: {host_us(fn, args.calls):.1f} us host per call")
            print(lines[-1], flush=True)
        prof = cProfile.Profile()
        spin(args.calls)
        prof.enable()
        for _ in range(args.calls):
            cuflash.attention(q, k, v)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        lines.append(s.getvalue())
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
