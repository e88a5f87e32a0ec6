"""Where the backward's time goes, and which tiles win: run on the GPU machine.

For each shape: torch flash/cudnn backward, cuflash backward (atomic dQ and deterministic), and the
pieces (K/V kernel with and without the atomic dQ product, the deterministic dQ kernel) for several
BackwardTile candidates. Same process, same inputs, triton's do_bench (median, L2 flushed).
"""

from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bwd_sweep.json")
    args = ap.parse_args()
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import cuflash
    from cuflash import gpu_backward, schedule
    from cuflash._problem import validate_backward

    cands = {
        64: [(64, 128, 8, 1), (32, 128, 8, 1), (64, 64, 4, 1), (32, 64, 4, 1)],
        128: [(32, 128, 8, 1), (32, 64, 4, 1), (64, 128, 8, 1), (16, 128, 8, 1)],
    }
    out = []
    for d, n, causal in [(64, 4096, False), (64, 4096, True), (128, 4096, False), (128, 4096, True)]:
        h, b = 2048 // d, 16384 // n
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        row = {"d": d, "n": n, "causal": causal, "tflops": {}}
        for name, be in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([be]):
                o_t = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            ms = do_bench(lambda: torch.autograd.grad(o_t, (qq, kk, vv), do, retain_graph=True), warmup=10, rep=50,
                          return_mode="median")
            row["tflops"][name] = flops / ms / 1e9
        qc, kc, vc, doc = (cp.from_dlpack(x) for x in (q, k, v, do))
        o, lse = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True)
        p = validate_backward(doc, qc, kc, vc, o, lse, causal=causal)
        lse3 = lse
        dq, dk, dv = cp.empty_like(qc), cp.empty_like(kc), cp.empty_like(vc)
        base = schedule.backward_tile(d)[1]
        for bm, bn, w, wd in cands[d]:
            t = schedule.BackwardTile(bm, bn, w, wd, base.dq_block_m, base.dq_block_n, base.dq_warps, base.dq_split, "sweep")
            key = f"{bm}x{bn}w{w}"
            for det in (False, True):
                try:
                    f = lambda: gpu_backward.backward(p, doc, qc, kc, vc, o, lse3, dq, dk, dv, deterministic=det, tile=t)
                    f()
                    cp.cuda.Device().synchronize()
                    ms = do_bench(f, warmup=10, rep=50, return_mode="median")
                    row["tflops"][key + ("-det" if det else "")] = flops / ms / 1e9
                except Exception as e:  # spills are fine here; compile errors are reported
                    row["tflops"][key + ("-det" if det else "")] = repr(e)[:160]
        # the pieces, default tile: K/V kernel alone without dQ (deterministic's first kernel)
        # is timed by subtracting: det total - dq kernel alone.
        print("BWDSWEEP", json.dumps({k_: (round(v_) if isinstance(v_, float) else v_) for k_, v_ in row["tflops"].items()}),
              d, n, causal, flush=True)
        out.append(row)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
