"""Row blocks against row tiles (GPU machine): one K/V head with many query heads (MQA, d=128 bf16),
its packed rows run as R blocks of group/R heads each (each block one or two 16-row tiles, each
reading the K/V head), for forced R next to the planner's, cuDNN and FA2 (torch SDPA), timed like
benchmarks/peers.py (L2 flushed, launch hidden).

    python3 tools/row_block_probe.py out.json [few]
"few": shapes with few (sequence, K/V head) blocks (B <= 4, L <= 64k), the planner's merge.
"""
import json
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

plan_cache.enabled = False  # the forced row-block count must reach every plan
SHAPES = [(1, 32, 1, 32768), (8, 32, 1, 32768), (1, 32, 1, 131072), (1, 64, 1, 32768), (8, 64, 1, 32768),
          (1, 128, 1, 32768), (1, 64, 8, 32768)]  # (B, Hq, Hkv, L)
MERGES = ("kernel", "last")
if len(sys.argv) > 2 and sys.argv[2] == "few":  # few blocks: row blocks of one row tile or two, the planner's merge
    SHAPES = [(1, 32, 1, 8192), (1, 32, 1, 16384), (1, 32, 1, 65536), (2, 32, 1, 32768), (4, 32, 1, 16384),
              (1, 64, 1, 16384), (1, 64, 1, 65536), (2, 64, 1, 32768), (1, 128, 1, 16384), (1, 48, 1, 32768),
              (1, 32, 1, 32768, 64), (1, 64, 1, 32768, 64), (1, 32, 1, 131072, 64), (1, 32, 1, 32768, 256)]
    MERGES = ("auto",)
planned = gpu_decode.row_blocks
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
out = []
for B, hq, hkv, L, *d_ in SHAPES:  # (a fifth value: the head dim, default 128)
    d = d_[0] if d_ else 128
    q = torch.randn(B, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    row = {"B": B, "hq": hq, "hkv": hkv, "L": L, "d": d, "us": {}}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([be]):
            ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["us"][name] = ms * 1e3
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    ref = cuflash.attention(qc, kc, vc).astype(cp.float32)
    group = hq // hkv
    gpu_decode.MAX_ROW_BLOCKS = 16
    cap = 16 * schedule.decode_tile(d)[1].max_row_tiles  # packed rows one block holds
    for r in [x for x in (1, 2, 4, 8, 16) if group % x == 0 and group // x <= cap]:
        # (the original problem only: the library asks again of the problem it planned, as hkv x R heads)
        gpu_decode.row_blocks = lambda p_, sm_count=None, r=r: r if p_.hkv == hkv else 1
        p = validate_forward(qc, kc, vc)
        o4 = cp.empty_like(qc)
        lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
        for merge in MERGES:
            key = f"R{r}-{merge}"
            try:
                lp = gpu_decode.launch_plan(p, gpu_decode._sm_count(0), cluster=False)
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, cluster=False, merge=merge)  # noqa: E731
                o4.fill(float("nan"))
                f()
                err = float(cp.abs(o4.astype(cp.float32) - ref).max())
                ms, _ = timer(f)
                row["us"][f"{key}[{lp.splits}x{lp.tile.block_n}]"] = ms * 1e3 if err < 0.02 else f"wrong {err}"
            except Exception as e:  # noqa: BLE001
                row["us"][key] = repr(e)[:80]
    gpu_decode.row_blocks, gpu_decode.MAX_ROW_BLOCKS = planned, 4
    ms, _ = timer(lambda: cuflash.attention(qc, kc, vc))
    row["us"]["api"] = ms * 1e3
    us = row["us"]
    best = min(us["cudnn"], us["flash"])
    print(f"B{B} H{hq}/{hkv} L{L} d{d}: cudnn {us['cudnn']:.1f} flash {us['flash']:.1f} | "
          + ", ".join(f"{k_} {v_:.1f} x{best / v_:.3f}" if isinstance(v_, float) else f"{k_} {v_}"
                      for k_, v_ in us.items() if k_ not in ("cudnn", "flash")), flush=True)
    out.append(row)
    del q, k, v, qc, kc, vc, ref
    json.dump(out, open(sys.argv[1], "w"), indent=1)
