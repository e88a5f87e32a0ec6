"""Time the wgmma backward (cp.async vs TMA-fed Q/dO) next to cuDNN's backward, same process.

    python3 tools/hopper_bwd_sweep.py [--d 64,128] [--n 1024,4096,16384] [--variants ws,tma] [--json OUT]

Both cuflash variants run through cuflash.attention_backward with the Hopper table patched; each
is first checked against the float64 reference (naive-error rule) on a small causal problem.
cuDNN: torch SDPA (CUDNN_ATTENTION) autograd of the same inputs. The benchmark's Timer flushes L2
and hides launch overhead. Ratios: cuDNN ms / cuflash ms (> 1: cuflash is faster).
"""
import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers import Timer  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from cuflash import gpu_hopper, schedule  # noqa: E402
from cuflash._arrays import BFLOAT16  # noqa: E402
from cuflash.testing import assert_backward_within_naive_error, random_inputs, to_numpy  # noqa: E402


def variants(hd):
    t = dataclasses.replace(schedule.HOPPER_BACKWARD_TILES[hd], tma=False, ws=False)
    tma = gpu_hopper.backward_tma(t)
    return {"tma": tma, "ws": dataclasses.replace(tma, ws=True),  # (the cp.async loads: 3-9% slower than tma)
            "ws-ms": dataclasses.replace(tma, ws=True, math_stats=True),
            "ws-persist": dataclasses.replace(tma, ws=True, persistent=True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--variants", help="comma list of variants() names (default: all)")
    args = ap.parse_args()
    timer = Timer(warmup=2, repeats=15, seconds_per_impl=1.0)
    rows, bad = [], 0
    table = dict(schedule.HOPPER_BACKWARD_TILES)
    schedule.HOPPER_BACKWARD_WS = {}  # each variant says itself whether it is warp-specialized
    for d in (int(x) for x in args.d.split(",")):
        vs = variants(d)
        if args.variants:
            vs = {name: vs[name] for name in args.variants.split(",")}
        for name, t in list(vs.items()):  # correctness first
            schedule.HOPPER_BACKWARD_TILES[d] = t
            try:
                rng = np.random.default_rng(d)
                q, k, v = random_inputs(rng, (2, 4, 257, d), (2, 2, 300, d), BFLOAT16)
                do = random_inputs(rng, (2, 4, 257, d), (2, 4, 257, d), BFLOAT16)[0]
                qg, kg, vg, dog = (cp.asarray(a) for a in (q, k, v, do))
                o, lse = cuflash.attention(qg, kg, vg, causal="bottom_right", return_lse=True)
                g = cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal="bottom_right")
                assert_backward_within_naive_error(tuple(to_numpy(x) for x in g), do, q, k, v, causal="bottom_right")
            except Exception as exc:  # noqa: BLE001 - reported, not timed
                bad += 1
                del vs[name]
                print(f"d={d} {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
        for n in (int(x) for x in args.n.split(",")):
            h, b = 2048 // d, 16384 // n
            tq, tk, tv, tdo = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            q, k, v, do = (cp.from_dlpack(x) for x in (tq, tk, tv, tdo))
            for causal in (False, True):
                flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1)
                qq, kk, vv = (x.clone().requires_grad_() for x in (tq, tk, tv))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                ref_ms, _ = timer(lambda: torch.autograd.grad(out, (qq, kk, vv), tdo, retain_graph=True))
                line = [f"d={d:3d} N={n:5d} causal={causal!s:5} cuDNN {ref_ms:.3f} ms {flops / ref_ms / 1e9:.0f} TF"]
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                for name, t in vs.items():
                    schedule.HOPPER_BACKWARD_TILES[d] = t
                    ms, _ = timer(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))
                    line.append(f"{name} {ms:.3f} {flops / ms / 1e9:.0f}TF x{ref_ms / ms:.3f}")
                    rows.append({"d": d, "n": n, "causal": causal, "variant": name, "ms": ms, "cudnn_ms": ref_ms,
                                 "vs_cudnn": ref_ms / ms, "tflops": flops / ms / 1e9})
                print("  ".join(line), flush=True)
                del out, qq, kk, vv
            del tq, tk, tv, tdo, q, k, v, do
            torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
        schedule.HOPPER_BACKWARD_TILES.update(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
