"""The forward's key split next to cuDNN (GPU machine): for each shape (default: the benchmark's
grid, 16k tokens x hidden 2048, bf16, full attention; --cases for others, e.g. grids under one
wave), cuflash as the API runs it, the table tile without the split, with the planner's split
count and with forced counts, alternated A B A B in one process on the same torch-made inputs
(benchmark Timer: L2 flushed, launch hidden). Each variant is checked against cuDNN's output.

    python3 tools/split_probe.py out.json [--d 64,128,192] [--n 1024,2048,4096,16384] [--forced 2,3,5]
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peers import Timer  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from cuflash import _problem, gpu_hopper, schedule  # noqa: E402


def arg(flag, default):
    return [int(x) for x in (sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default).split(",")]


SMS = torch.cuda.get_device_properties(0).multi_processor_count
timer = Timer(warmup=2, repeats=20, seconds_per_impl=0.5)
out = []
if "--cases" in sys.argv:  # "B*H,N,d;..." (batch x heads folded into the heads)
    CASES = [tuple(int(x) for x in c.split(",")) for c in sys.argv[sys.argv.index("--cases") + 1].split(";")]
else:  # the benchmark's grid
    CASES = [((16384 // n) * (2048 // d), n, d) for d in arg("--d", "64,128,192") for n in arg("--n", "1024,2048,4096,16384")]
for bh, n, d in CASES:
        q, k, v = (torch.randn(1, bh, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
        p = _problem.validate_forward(qc, kc, vc)
        tile = gpu_hopper.default_tile(d, None, n, n)
        if tile.persistent:  # the persistent kernel has no split: time the table tile's
            tile = schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(d)]
        tiles = -(-n // tile.block_m) * bh
        plan = gpu_hopper.split_plan(p, tile, SMS)
        o4 = cp.empty_like(qc)
        lse = cp.empty((1, bh, n), cp.float32)
        # api: the dispatch's own tile and plan
        variants = {"api": (None, None), "nosplit": (tile, False)}
        if plan:
            variants["plan"] = (tile, plan)
        for ks in arg("--forced", "2,3,5"):
            if ks != plan:
                variants[f"k{ks}"] = (tile, ks)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v)
        row = {"d": d, "n": n, "bh": bh, "tiles": tiles, "plan": plan, "tile": tile.block_m, "ms": {}, "err": {}}
        for name, (t, split) in variants.items():
            o4.fill(float("nan"))
            gpu_hopper.forward(p, qc, kc, vc, o4, lse, tile=t, split=split)
            row["err"][name] = float(cp.abs(o4.astype(cp.float32) - cp.from_dlpack(ref).astype(cp.float32)).max())
        for rep in range(2):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v))
            row["ms"].setdefault("cudnn", []).append(ms)
            for name, (t, split) in variants.items():
                ms, _ = timer(lambda: gpu_hopper.forward(p, qc, kc, vc, o4, lse, tile=t, split=split))
                row["ms"].setdefault(name, []).append(ms)
        c = np.mean(row["ms"]["cudnn"])
        print(f"SPLIT d={d} n={n} tiles={tiles} ({tiles / SMS:.2f} waves) plan={plan} "
              + " ".join(f"{k_}: x{c / np.mean(v_):.3f} ({'/'.join(f'{c / x:.3f}' for x in v_)}) err {row['err'].get(k_, 0):.2g}"
                         for k_, v_ in row["ms"].items() if k_ != "cudnn"), flush=True)
        out.append(row)
        del q, k, v, qc, kc, vc, ref
json.dump(out, open(sys.argv[1], "w"), indent=1)
