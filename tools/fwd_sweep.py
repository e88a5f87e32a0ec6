"""Device-side exploration of the forward kernel: quick correctness against torch, then a tile sweep.

Run on the GPU machine: PYTHONPATH=. python3 tools/fwd_sweep.py --out $OUT/sweep.json
Everything is timed in one process on the same inputs (triton's do_bench: median, L2 flushed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--n", default="4096,16384")
    args = ap.parse_args()

    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import cuflash
    from cuflash import gpu, schedule
    from cuflash._layout import to_bhsd
    from cuflash._problem import validate_forward

    results = {"check": [], "sweep": []}
    torch.manual_seed(0)

    def tt(shape, dtype):
        return torch.randn(shape, device="cuda", dtype=dtype)

    # ---- correctness: cuflash vs torch math in float32 on upcast inputs ----
    cases = [
        # (b, hq, hkv, nq, nk, d, causal, dtype)
        (2, 4, 4, 200, 200, 64, False, torch.bfloat16),
        (2, 4, 4, 200, 200, 64, "top_left", torch.bfloat16),
        (1, 8, 2, 113, 203, 128, True, torch.float16),
        (1, 8, 2, 203, 113, 128, True, torch.bfloat16),
        (1, 4, 1, 1, 239, 128, True, torch.bfloat16),
        (1, 2, 2, 1025, 1023, 256, False, torch.bfloat16),
        (1, 2, 2, 1023, 1025, 256, "top_left", torch.float16),
        (1, 2, 2, 97, 97, 40, False, torch.bfloat16),
        (1, 2, 2, 97, 130, 111, True, torch.float16),
        (1, 2, 2, 300, 300, 96, True, torch.bfloat16),
        (1, 2, 2, 300, 300, 32, True, torch.bfloat16),
        (1, 2, 2, 300, 300, 192, False, torch.bfloat16),
        (2, 4, 4, 4096, 4096, 128, True, torch.bfloat16),
        (2, 4, 4, 300, 300, 64, False, torch.float32),
        (2, 4, 4, 300, 300, 128, True, torch.float32),
    ]
    for b, hq, hkv, nq, nk, d, causal, dt in ([] if args.no_check else cases):
        q, k, v = tt((b, hq, nq, d), dt), tt((b, hkv, nk, d), dt), tt((b, hkv, nk, d), dt)
        qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
        out = cp.full(qc.shape, cp.nan, dtype=qc.dtype)
        try:
            o, lse = cuflash.attention(qc, kc, vc, causal=causal, return_lse=True, out=out)
            cp.cuda.Device().synchronize()
            o_t = torch.from_dlpack(o).float()
            lse_t = torch.from_dlpack(lse)
            # float64 reference with explicit mask (bottom-right or top-left)
            g = hq // hkv
            qf, kf, vf = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
            s = qf @ kf.transpose(-1, -2) / math.sqrt(d)
            if causal:
                off = (nk - nq) if causal in (True, "bottom_right") else 0
                i = torch.arange(nq, device="cuda")[:, None]
                j = torch.arange(nk, device="cuda")[None, :]
                s = s.masked_fill(j > i + off, float("-inf"))
            lse_r = torch.logsumexp(s, -1)
            p = torch.exp(s - lse_r[..., None]).nan_to_num(0.0)
            o_r = p @ vf
            err = (o_t.double() - o_r).abs().max().item()
            fin = torch.isfinite(lse_r)
            lerr = (lse_t.double()[fin] - lse_r[fin]).abs().max().item() if fin.any() else 0.0
            lse_ok = bool(torch.equal(torch.isinf(lse_t), torch.isinf(lse_r)))
            # the same formula in the input dtype, for scale
            sn = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)).float() / math.sqrt(d)
            naive_err = None
            rec = dict(case=[b, hq, hkv, nq, nk, d, str(causal), str(dt)], max_err=err, lse_err=lerr,
                       lse_inf_match=lse_ok, nan=bool(torch.isnan(o_t).any().item()))
        except Exception as e:  # report, keep going
            rec = dict(case=[b, hq, hkv, nq, nk, d, str(causal), str(dt)], error=repr(e)[:500])
        results["check"].append(rec)
        print("CHECK", rec, flush=True)

    # ---- ceilings ----
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, warmup=25, rep=200, return_mode="median")
    results["matmul_tflops"] = 2 * 8192**3 / ms / 1e9
    del a
    # ---- sweep ----
    shapes = [(int(d), int(n)) for d in args.d.split(",") for n in args.n.split(",")]
    cands = {
        64: [(128, 64, 4, 2), (128, 64, 4, 2, False), (128, 64, 4, 3, False), (128, 128, 8, 2)],
        128: [(128, 64, 4, 2), (128, 32, 4, 2), (128, 32, 4, 2, False), (128, 32, 4, 3, False), (128, 128, 8, 2)],
        256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
    }
    for d, n in shapes:
        h = 2048 // d
        b = 16384 // n
        for causal in (False, True):
            q, k, v = (tt((b, h, n, d), torch.bfloat16) for _ in range(3))
            qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row = {"d": d, "n": n, "b": b, "h": h, "causal": causal, "tflops": {}}
            for name, be in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel([be]):
                        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal)),
                                      warmup=25, rep=100, return_mode="median")
                    row["tflops"][name] = flops / ms / 1e9
                except Exception as e:
                    row["tflops"][name] = repr(e)[:100]
            p = validate_forward(qc, kc, vc, causal=causal)
            o4 = cp.empty_like(qc)
            lse3 = cp.empty((b, h, n), dtype=cp.float32)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            for cand in cands[d]:
                bm, bn, w, st = cand[:4]
                lazy = cand[4] if len(cand) > 4 else True
                t = schedule.TileConfig(bm, bn, w, st, "sweep", lazy_rescale=lazy)
                key = f"{bm}x{bn}w{w}s{st}" + ("" if lazy else "-eager")
                try:
                    gpu.forward(p, qc, kc, vc, o4, lse3, tile=t)
                    cp.cuda.Device().synchronize()
                    diff = (torch.from_dlpack(o4).float() - ref.float()).abs().max().item()
                    ms = do_bench(lambda: gpu.forward(p, qc, kc, vc, o4, lse3, tile=t), warmup=25, rep=100,
                                  return_mode="median")
                    row["tflops"][key] = flops / ms / 1e9
                    row.setdefault("diff", {})[key] = diff
                except Exception as e:
                    row["tflops"][key] = repr(e)[:200]
            results["sweep"].append(row)
            print("SWEEP", json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"matmul ceiling {results['matmul_tflops']:.0f} TFLOP/s")
    for row in results["sweep"]:
        best = {k: round(v) for k, v in row["tflops"].items() if isinstance(v, float)}
        print(row["d"], row["n"], row["causal"], best)


if __name__ == "__main__":
    sys.exit(main())
