"""Time wgmma forward tiles (cp.async, warp-specialized, TMA-fed) next to cuDNN, each checked first.

    python3 tools/hopper_fwd_sweep.py [--d 64,128,256] [--n 1024,4096,16384] [--dtype bf16] [--json OUT]

Every tile is first compared with the float64 reference on small causal and non-causal inputs by
the naive-error rule; a failing tile is reported and not timed. Timing uses the benchmark's Timer
(L2 flushed, launch hidden behind a spin) on the same torch-made inputs that cuDNN (torch SDPA,
CUDNN_ATTENTION) gets, in this process; ratios are cuDNN ms / tile ms (> 1: the tile is faster).
"""
import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers import Timer  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from cuflash import _problem, gpu_hopper, schedule  # noqa: E402
from cuflash._layout import to_bhsd  # noqa: E402
from cuflash.schedule import HopperTile  # noqa: E402
from cuflash.testing import assert_forward_within_naive_error  # noqa: E402


def T(bn, wg, st, kind="", wg_epilogue=False):
    # kinds: "" cp.async, "ws" warp-specialized cp.async, "tma", "pp" (TMA ping-pong), and the
    # persistent TMA kernels "ptma" / "ppp" (one block per SM walking the query tiles)
    return HopperTile(bn, wg, st, kind or "cp.async", kind == "ws", kind in ("tma", "pp", "ptma", "ppp"),
                      kind in ("pp", "ppp"), kind in ("ptma", "ppp"), wg_epilogue)


# The cp.async tile, the TMA table tile (first TMA entry) and alternatives measured against it.
CANDIDATES = {
    64: [T(128, 3, 2, "pp"), T(128, 2, 2, "ppp"), T(128, 2, 2, "ppp", True), T(128, 3, 2, "ppp", True),
         T(192, 2, 2, "pp"), T(192, 2, 2, "ppp", True),  # 192-key tiles: slower (eighth session)
         T(128, 3, 3, "pp"), T(128, 2, 3, "ppp", True),  # 3 stages: 1-3% slower (evidence-20261130h)
         T(128, 3, 3, "ppp", True), T(64, 2, 3, "ppp", True), T(64, 2, 4, "ppp", True)],
    128: [T(128, 2, 2, "tma"), T(128, 2, 2, "ppp"), T(128, 2, 2, "ppp", True), T(128, 2, 2, "ptma", True),
          T(128, 2, 2, "tma", True),  # the table tile with each warpgroup storing its own O rows
          T(128, 2, 2, "pp"),  # ping-pong per tile (with -DCUFLASH_FWD_UNIFORM_ALL=1: twelfth session)
          T(160, 2, 2, "tma"), T(176, 2, 2, "tma"), T(176, 2, 2, "pp"), T(192, 2, 2, "tma"),
          T(128, 2, 3, "tma"), T(128, 2, 3, "tma", True),
          T(64, 3, 2, "pp"), T(64, 3, 3, "pp"), T(64, 3, 2, "ppp", True), T(80, 3, 2, "pp")],  # 3 math warpgroups at 160 regs  # longer key tiles (FA3: 176 without a mask)
    192: [T(64, 2, 2), T(96, 2, 2, "pp"), T(96, 2, 2, "tma"), T(96, 2, 2, "tma", True),
          T(64, 2, 2, "tma"), T(64, 2, 2, "tma", True), T(64, 2, 2, "pp")],
    256: [T(64, 2, 2), T(64, 2, 2, "tma"), T(80, 2, 2, "tma"), T(80, 2, 2, "pp"), T(80, 2, 2, "tma", True),
          T(64, 2, 2, "pp"), T(64, 2, 2, "tma", True)],
}


def name(t):
    kind = ("PP" if t.pingpong else "T") if t.tma else ("P" if t.producer else "")
    kind += "-persist" if t.persistent else ""
    kind += "-wgepi" if t.wg_epilogue else ""
    return f"{t.block_m}x{t.block_n}wg{t.warpgroups}s{t.stages}{kind}"


def run(q, k, v, causal, tile, out=None):
    p = _problem.validate_forward(q, k, v, causal=causal)
    o = out if out is not None else cp.empty(q.shape, q.dtype)
    lse = cp.empty((p.batch, p.hq, p.nq), cp.float32)
    gpu_hopper.forward(p, to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk),
                       to_bhsd(o, p, p.hq, p.nq), lse, tile=tile)
    return o, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json")
    ap.add_argument("--tiles", default="", help="comma list: keep only candidates with these names")
    args = ap.parse_args()
    np_dt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[args.dtype]
    t_dt = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    rng = np.random.default_rng(0)
    timer = Timer(warmup=2, repeats=20, seconds_per_impl=1.0)
    rows, bad = [], 0
    for d in (int(x) for x in args.d.split(",")):
        ok = []
        keep = set(filter(None, args.tiles.split(",")))
        for t in CANDIDATES[d]:
            if keep and name(t) not in keep:
                continue
            try:
                for causal in (False, "bottom_right"):
                    q, k, v = (rng.standard_normal((2, 2, n, d)).astype(np_dt) for n in (333, 300, 300))
                    o, lse = run(*(cp.asarray(a) for a in (q, k, v)), causal, t)
                    assert_forward_within_naive_error(cp.asnumpy(o), cp.asnumpy(lse), q, k, v, causal=causal)
                ok.append(t)
            except Exception as exc:  # noqa: BLE001 - reported, not timed
                bad += 1
                print(f"d={d} {name(t)}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
        for n in (int(x) for x in args.n.split(",")):
            h, b = 2048 // d, 16384 // n
            tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=t_dt) for _ in range(3))
            q, k, v = (cp.from_dlpack(x) for x in (tq, tk, tv))
            for causal in (False, True):
                flops = 4 * n * n * d * h * b * (0.5 if causal else 1)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    ref_ms, _ = timer(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                line = [f"d={d:3d} N={n:5d} causal={causal!s:5} cuDNN {ref_ms:.3f} ms {flops / ref_ms / 1e9:.0f} TF"]
                out = cp.empty(q.shape, q.dtype)
                for t in ok:
                    ms, _ = timer(lambda: run(q, k, v, "top_left" if causal else False, t, out))
                    line.append(f"{name(t)} {ms:.3f} {flops / ms / 1e9:.0f}TF x{ref_ms / ms:.2f}")
                    rows.append({"d": d, "n": n, "causal": causal, "tile": name(t), "ms": ms, "cudnn_ms": ref_ms,
                                 "vs_cudnn": ref_ms / ms, "tflops": flops / ms / 1e9})
                print("  ".join(line), flush=True)
            del tq, tk, tv, q, k, v
            torch.cuda.empty_cache()
            cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
