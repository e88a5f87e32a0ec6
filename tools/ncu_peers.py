"""What the peers' kernels look like (launch geometry, registers, shared memory, achieved
throughput) next to cuflash's, for the cells still short of cuDNN: run under ncu with
--profile-from-start off; every op is warmed up first, then run once between
cudaProfilerStart/Stop.

    ncu --clock-control none --profile-from-start off --section LaunchStats --section Occupancy \
        --section SpeedOfLight python3 tools/ncu_peers.py > ncu_peers.txt
"""
import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from decode_cells import decode_inputs  # (tools/, this script's directory)


def _decode_pair(kind, shape, peer, backend, nk, b, hkv, hq=32, d=128):
    """[(peer's op, its callable), (cuflash's op, its callable)] on one decode cell's inputs, the ops
    named "<kind> <peer or cuflash> <shape>" (ncu_digest matches them to the kernels)."""
    tq, tk, tv, _ = decode_inputs(nk, b, hkv, hq, d)
    q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))

    def sdpa():
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    return [(f"{kind} {peer} {shape}", sdpa), (f"{kind} cuflash {shape}", lambda: cuflash.attention(q, k, v))]


def decode_ops(b, hkv, nk):
    return _decode_pair("decode", f"B={b} Hkv={hkv} L={nk}", "cuDNN", SDPBackend.CUDNN_ATTENTION, nk, b, hkv)


def mqa_ops(b, hq, nk, d):
    """MQA decode (one K/V head, hq query heads, one token): FA2 (the faster peer there) and cuflash."""
    return _decode_pair("mqa", f"B={b} Hq={hq} L={nk} d={d}", "FA2", SDPBackend.FLASH_ATTENTION, nk, b, 1, hq, d)


def bwd_ops(d, n, causal):
    b, h = 16384 // n, 2048 // d
    tq, tk, tv, tdo = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qq, kk, vv = (x.clone().requires_grad_() for x in (tq, tk, tv))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    return [(f"bwd cuDNN d={d} N={n} causal={causal}",
             lambda: torch.autograd.grad(out, (qq, kk, vv), tdo, retain_graph=True)),
            (f"bwd cuflash d={d} N={n} causal={causal}",
             lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))]


def fwd_ops(d, n, causal):
    b, h = 16384 // n, 2048 // d
    tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return [(f"fwd cuDNN d={d} N={n} causal={causal}", cudnn),
            (f"fwd cuflash d={d} N={n} causal={causal}", lambda: cuflash.attention(q, k, v, causal=causal))]


def main():
    import os

    if os.environ.get("NCU_OPS"):  # e.g. "decode:8,32,65536;fwd:128,4096,0;bwd:64,4096,1;mqa:64,64,16384,128"
        make = {"decode": decode_ops, "fwd": fwd_ops, "bwd": bwd_ops, "mqa": mqa_ops}
        ops = []
        for item in os.environ["NCU_OPS"].split(";"):
            kind, args = item.split(":")
            vals = [int(x) for x in args.split(",")]
            ops += make[kind](*vals[:2], bool(vals[2])) if kind in ("fwd", "bwd") else make[kind](*vals)
    else:
        ops = decode_ops(8, 8, 4096) + decode_ops(64, 8, 4096) + decode_ops(8, 32, 4096)
        ops += bwd_ops(64, 4096, True) + bwd_ops(128, 4096, True) + bwd_ops(64, 4096, False)
        ops += fwd_ops(64, 1024, False) + fwd_ops(256, 1024, False)
    for _, fn in ops:  # compile, plan, pick cuDNN engines
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in ops:
        print("OP", name, flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
