"""Decode probe (GPU machine): cuDNN / FA2 vs cuflash's split-KV decode over tile shapes, ring
depths and split waves on the peers' decode grid, timed like benchmarks/peers.py (L2 flushed,
launch hidden behind a GPU spin), plus the host time of one cuflash.attention call.

    python tools/decode_probe.py out.json [--quick]
    DECODE_SMEM_PAD=110000 python tools/decode_probe.py out.json --split-cells   # same code, fewer blocks per SM
    DECODE_LENS=4096,8192 ...   # other cache lengths than the grid's 4k / 16k / 64k
    DECODE_CANDS="16,4,4;32,4,3;16,4,2,1" python tools/decode_probe.py out.json --many-cells   # other
        tiles on the cells without splits (block_n, warps, stages[, ring[, max blocks per SM]];
        DECODE_WAVES, default 1)
    DECODE_SPLITS=2 DECODE_CANDS="16,4,2,2,2" python tools/decode_probe.py out.json --many-cells   # each
        candidate tile also with that many splits per (sequence, head), merged in a cluster
    python tools/decode_probe.py out.json --cluster   # how the splits merge: in a thread-block
        cluster (cluster2/4/8) vs the combine kernel (combine = its own split count, combine2/4/8),
        every cell; "api" is the planner's choice (row["plan"])
"""
import json
import os
import sys
import time

sys.path.insert(0, ".")
import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash
from benchmarks.peers import Timer
from cuflash import gpu_decode, schedule
from cuflash._problem import validate_forward

if os.environ.get("DECODE_SMEM_PAD"):  # occupancy probe: every cp.async decode launch asks for at least this
    # many bytes of shared memory (same code, fewer blocks per SM), e.g. 110000 for 2 blocks per SM
    _pad, _orig = int(os.environ["DECODE_SMEM_PAD"]), schedule.DecodeTile.smem_bytes
    schedule.DecodeTile.smem_bytes = lambda self, hd, rt: max(_orig(self, hd, rt), _pad)

quick = "--quick" in sys.argv
timer = Timer(warmup=3, repeats=30, seconds_per_impl=0.3)
from decode_cells import CELLS, decode_inputs  # the peers' decode grid (tools/, this script's folder)
CANDS = [(16, 4, 2), (16, 4, 3)]
WAVES = (1, 2)
TMA_CANDS = [(4, 6), (4, 4), (4, 3), (4, 2), (8, 3), (8, 2), (2, 8), (2, 4), (6, 4)]
TMA_WAVES = (1, 2, 3, 4)
if os.environ.get("DECODE_LENS"):  # other cache lengths on the same (B, Hkv) pairs, e.g. "4096,8192,16384"
    CELLS = [(L, B, hkv) for L in map(int, os.environ["DECODE_LENS"].split(",")) for B, hkv in ((8, 8), (64, 8), (8, 32))]
if quick:
    CELLS, TMA_CANDS = CELLS[:3], TMA_CANDS[:3]
if "--default-only" in sys.argv:  # the API's own choice against the peers, every cell
    CANDS, TMA_CANDS = [], []
if "--split-cells" in sys.argv:  # the cells with few (sequence, head) blocks: split count sweep
    CELLS = [c for c in CELLS if c[1] * c[2] < 132]
    CANDS, WAVES, TMA_CANDS = [(16, 4, 2), (16, 4, 3)], (1, 2, 3, 4, 6), []
if "--many-cells" in sys.argv:  # the cells with a (sequence, head) block per SM (no split)
    CELLS = [c for c in CELLS if c[1] * c[2] >= 132]
    TMA_CANDS = []
if os.environ.get("DECODE_CANDS"):  # "block_n,warps,stages;..." (e.g. deeper rings), with DECODE_WAVES
    CANDS = [tuple(int(x) for x in c.split(",")) for c in os.environ["DECODE_CANDS"].split(";")]
    WAVES = tuple(int(x) for x in os.environ.get("DECODE_WAVES", "1").split(","))
MERGES = []  # (key, forward keywords): the split merge, cluster vs combine kernel, default tile
if "--cluster" in sys.argv:
    CANDS, TMA_CANDS = [], []
    MERGES = [("combine", dict(cluster=False))]
    MERGES += [(f"{name}{s}", dict(cluster=name == "cluster", splits=s)) for s in (2, 4, 8) for name in ("cluster", "combine")]
out = []
for L, B, hkv in CELLS:
    hq, d = 32, 128
    q, k, v, nbytes = decode_inputs(L, B, hkv, hq, d)
    row = {"L": L, "B": B, "hkv": hkv, "tbps": {}, "ms": {}}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([be]):
            ms, _ = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["ms"][name], row["tbps"][name] = ms, nbytes / ms / 1e9
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    ms, _ = timer(lambda: cuflash.attention(qc, kc, vc))
    row["ms"]["api"], row["tbps"]["api"] = ms, nbytes / ms / 1e9
    # host cost of one call: launches queued behind a long spin, so the host is the only clock
    torch.cuda._sleep(50_000_000)
    t0 = time.perf_counter()
    for _ in range(50):
        cuflash.attention(qc, kc, vc)
    row["host_us_per_call"] = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    if L == 4096 and B == 8 and hkv == 8 and "--profile" in sys.argv:
        import cProfile, pstats, io
        pr = cProfile.Profile()
        torch.cuda._sleep(200_000_000)
        pr.enable()
        for _ in range(200):
            cuflash.attention(qc, kc, vc)
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print(buf.getvalue()[:6000], flush=True)
    p = validate_forward(qc, kc, vc)
    dev = cp.cuda.Device()
    lp = gpu_decode.launch_plan(p, dev.attributes["MultiProcessorCount"], clusters=int(dev.compute_capability) >= 90)
    row["plan"] = {"splits": lp.splits, "cluster": lp.cluster, "chunk": lp.chunk, "stages": lp.tile.stages}
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, 1), dtype=cp.float32)
    ref = cp.empty_like(qc)
    gpu_decode.forward(p, qc, kc, vc, ref, lse3, tile=schedule.DecodeTile(16, 4, 2, 2, "reference"), cluster=False)
    variants = [(f"{c[0]}x{c[1]}s{c[2]}v{wv}" + (f"r{c[3]}" if len(c) > 3 and c[3] else "")
                 + (f"b{c[4]}" if len(c) > 4 and c[4] else ""),
                 dict(tile=schedule.DecodeTile(c[0], c[1], c[2], 2, "probe", *c[3:5]), waves=wv))
                for c in CANDS for wv in WAVES]
    variants += [(f"{c[0]}x{c[1]}s{c[2]}" + (f"r{c[3]}" if len(c) > 3 and c[3] else "")
                  + (f"b{c[4]}" if len(c) > 4 and c[4] else "") + f"c{n}",
                  dict(tile=schedule.DecodeTile(c[0], c[1], c[2], 2, "probe", *c[3:5]), splits=n, cluster=True))
                 for c in CANDS for n in map(int, filter(None, os.environ.get("DECODE_SPLITS", "").split(",")))]
    variants += [(f"tma{cw}s{st}v{wv}", dict(tma_tile=schedule.DecodeTmaTile(cw, st, 2, "probe"), waves=wv))
                 for cw, st in TMA_CANDS for wv in TMA_WAVES]
    variants += MERGES
    for key, kw in variants:
            try:
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, **kw)
                f()
                err = float(cp.abs(o4.astype(cp.float32) - ref.astype(cp.float32)).max())
                ms, _ = timer(f)
                row["ms"][key], row["tbps"][key] = ms, nbytes / ms / 1e9
                if err > 0.05:
                    row["tbps"][key] = f"wrong: {err}"
            except Exception as e:
                row["tbps"][key] = repr(e)[:100]
    best = sorted(((v_, k_) for k_, v_ in row["tbps"].items() if isinstance(v_, float) and k_ not in ("cudnn", "flash")), reverse=True)[:6]
    print("DECODE", L, B, hkv, "cudnn %.2f flash %.2f api %.2f host %.0fus" % (row["tbps"]["cudnn"], row["tbps"]["flash"], row["tbps"]["api"], row["host_us_per_call"]),
          [(k_, round(v_, 2)) for v_, k_ in best], flush=True)
    if MERGES:  # microseconds, so the fixed cost shows: cuDNN, the planner's choice, each merge
        us = {k_: t_ if isinstance(t_, str) else round(row["ms"][k_] * 1e3, 1) for k_, t_ in row["tbps"].items()}
        print("MERGE", L, B, hkv, "plan", row["plan"], "us", us, flush=True)
    out.append(row)
    del q, k, v, qc, kc, vc
json.dump(out, open(sys.argv[1], "w"), indent=1)
