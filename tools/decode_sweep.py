"""Decode tile / split sweep on shapes outside the issue grid (GPU machine): cuflash's split-KV
kernel with explicit tiles and split counts next to cuDNN and FlashAttention-2 (torch SDPA), same
process and inputs, timed like benchmarks/peers.py (L2 flushed, launch hidden).

    python3 tools/decode_sweep.py out.json SWEEP
SWEEP: "spec" (several query tokens per sequence, d=128), "long" (one to four long sequences,
d=128), "longpdl [min bytes]" (the same with the combine kernel a programmatic dependent from that
cache size, default 0: always), "few" (few pairs at d=128 / 192 / 256: split counts filling two or
three blocks per SM, combine merge), "d256" / "d256b" (head dims 192 / 256: tiles x split counts),
"misc" (the planner alone on other shapes: d=64 / 256, fp16, Hq=64, one 128k sequence, B=32 L=2k),
"merge [groups]" (few pairs: the partials merged by the last split or by the combine kernel, a few split
counts; "groups": shapes with more 4-column groups per pair than a split block has threads), "wide" (GQA 8 / 16,
MQA, short and mid caches: the planner, its splits merged both ways), "nosplit"
(the grid's cells with a block per pair, split in 2-4 anyway: through memory or in a cluster).
A variant is tile (block_n, warps, stages, ring, max blocks per SM) x splits (None: the planner's
count for that tile) x cluster (None: the planner's merge); "api" is cuflash.attention itself.
(evidence-20261201/sweeps/ holds the H200 runs.)
"""
import json
import os
import sys

sys.path.insert(0, ".")
import cupy as cp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, schedule  # noqa: E402
from cuflash._problem import validate_forward  # noqa: E402

SWEEP = sys.argv[2]
T = lambda *c: schedule.DecodeTile(c[0], c[1], c[2], 2, "sweep", *c[3:5])  # noqa: E731
if SWEEP == "long":  # (B, Hq, Hkv, nq, L, d)
    SHAPES = [(1, 32, 8, 1, 131072, 128), (1, 32, 8, 1, 32768, 128), (2, 32, 8, 1, 65536, 128), (4, 32, 8, 1, 32768, 128)]
    TILES = [("r0", T(16, 4, 2)), ("r2cap", T(16, 4, 2, 2, 2)), ("r2", T(16, 4, 2, 2)), ("r1", T(16, 4, 2, 1))]
    SPLITS = [None, 16, 24, 32, 48, 64]
elif SWEEP == "d256":
    SHAPES = [(8, 32, 8, 1, 16384, 256), (8, 32, 8, 1, 4096, 256), (64, 32, 8, 1, 4096, 256), (1, 32, 8, 1, 65536, 256)]
    TILES = [("16x4s2", T(16, 4, 2)), ("16x2s2", T(16, 2, 2)), ("16x2s3", T(16, 2, 3)), ("16x4s2r2", T(16, 4, 2, 2)),
             ("16x2s2r2", T(16, 2, 2, 2)), ("16x1s4", T(16, 1, 4))]
    SPLITS = [None]
elif SWEEP == "d256b":  # head dims 192 / 256 on split cells: tiles x split counts
    SHAPES = [(8, 32, 8, 1, 16384, 256), (8, 32, 8, 1, 65536, 256), (8, 32, 8, 1, 16384, 192), (64, 32, 8, 1, 4096, 192),
              (8, 32, 32, 1, 16384, 256)]
    TILES = [("16x4s2", T(16, 4, 2)), ("16x2s2", T(16, 2, 2)), ("16x2s3", T(16, 2, 3)), ("32x2s2", T(32, 2, 2))]
    SPLITS = [None, 4, 6, 8, 12]
elif SWEEP == "longpdl":  # few long sequences: the combine as a programmatic dependent at every size
    gpu_decode.PDL_COMBINE_MIN_BYTES = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    SHAPES = [(1, 32, 8, 1, 32768, 128), (1, 32, 8, 1, 131072, 128), (2, 32, 8, 1, 65536, 128), (4, 32, 8, 1, 32768, 128),
              (1, 32, 8, 1, 8192, 128)]
    TILES = [("r0", T(16, 4, 2)), ("r2", T(16, 4, 2, 2))]
    SPLITS = [None, 16, 24, 32]
elif SWEEP == "misc":  # (B, Hq, Hkv, nq, L, d[, dtype]): the planner's choice only
    SHAPES = [(8, 32, 8, 1, 16384, 64), (8, 32, 8, 1, 16384, 256), (8, 32, 8, 4, 16384, 256),
              (8, 32, 8, 1, 16384, 128, torch.float16), (8, 64, 8, 1, 16384, 128), (1, 32, 8, 1, 131072, 128),
              (32, 32, 8, 1, 2048, 128)]
    TILES, SPLITS = [], [None]
elif SWEEP == "few":  # few (sequence, K/V head) pairs at d=128 / 192 / 256: split counts, combine merge, PDL combine
    gpu_decode.PDL_COMBINE_MIN_BYTES = 0
    SHAPES = [(B, 32, 8, 1, L, 128) for B in (1, 2, 4) for L in (8192, 32768, 131072)] + [
        (8, 32, 8, 1, 16384, 192), (8, 32, 8, 1, 4096, 256), (1, 32, 8, 1, 65536, 256), (2, 32, 8, 1, 32768, 256)]
    TILES = None  # per head dim below
    SPLITS = None
elif SWEEP == "merge":  # the workspace's partials merged by the last split against the combine kernel
    gpu_decode.PDL_COMBINE_MIN_BYTES = 0
    SHAPES = [(B, 32, 8, 1, L, 128) for B in (1, 2, 4) for L in (8192, 32768, 131072)] + [
        (8, 32, 8, 1, 65536, 128), (1, 32, 8, 1, 65536, 256), (2, 32, 8, 1, 32768, 256), (1, 32, 8, 1, 32768, 64)]
    if len(sys.argv) > 3 and sys.argv[3] == "groups":  # more 4-column groups than threads: GQA 8, two tokens, d=192
        SHAPES = [(1, 64, 8, 1, 8192, 128), (1, 64, 8, 1, 32768, 128), (2, 64, 8, 1, 32768, 128),
                  (1, 32, 8, 2, 32768, 128), (1, 32, 8, 4, 32768, 128), (1, 32, 8, 1, 32768, 192)]
    TILES, SPLITS = None, None
elif SWEEP == "wide":  # shapes serving runs outside the grid: GQA 8 / 16, MQA, short and mid caches; the planner and both merges
    # (WIDE_PDL=0: the combine kernel launched plainly by the variants, not as a programmatic dependent)
    gpu_decode.PDL_COMBINE_MIN_BYTES = 0 if os.environ.get("WIDE_PDL", "1") == "1" else 1 << 62
    SHAPES = [(1, 64, 8, 1, 32768, 128), (1, 64, 8, 1, 131072, 128), (4, 64, 8, 1, 32768, 128),
              (1, 32, 1, 1, 32768, 128), (1, 32, 1, 1, 131072, 128), (8, 32, 1, 1, 32768, 128),
              (1, 128, 8, 1, 32768, 128), (1, 32, 4, 1, 32768, 128), (16, 32, 8, 1, 8192, 128),
              (1, 32, 8, 1, 2048, 128), (1, 64, 1, 1, 32768, 128), (8, 64, 1, 1, 32768, 128), (1, 128, 1, 1, 32768, 128),
              (4, 48, 1, 2, 16384, 128)]
    TILES, SPLITS = None, None
elif SWEEP == "mqa":  # one K/V head (32 packed rows: two row tiles): tiles x split counts; Hq=16 / 64 for comparison
    gpu_decode.PDL_COMBINE_MIN_BYTES = 0
    SHAPES = [(1, 32, 1, 1, 32768, 128), (1, 32, 1, 1, 131072, 128), (8, 32, 1, 1, 32768, 128),
              (1, 16, 1, 1, 32768, 128), (1, 64, 1, 1, 32768, 128)]
    TILES = [("16x4s2", T(16, 4, 2)), ("16x4s2r2", T(16, 4, 2, 2)), ("16x8s2", T(16, 8, 2)), ("16x4s3", T(16, 4, 3)),
             ("32x4s2", T(32, 4, 2))]
    SPLITS = [None, 64, 256]
elif SWEEP == "nosplit":  # the grid's cells with a block per (sequence, head): split anyway, merged by the last split
    SHAPES = [(8, 32, 32, 1, 65536, 128), (8, 32, 32, 1, 16384, 128), (64, 32, 8, 1, 4096, 128)]
    TILES, SPLITS = None, None
else:
    SHAPES = [(8, 32, 8, n, 16384, 128) for n in (1, 2, 4, 8, 16)] + [(8, 32, 32, 4, 16384, 128)]
    TILES = []
    SPLITS = [None]

timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
SMS = gpu_decode._sm_count(cp.cuda.Device().id)
out = []
for B, hq, hkv, nq, L, d, *dtype in SHAPES:
    dt = dtype[0] if dtype else torch.bfloat16
    q = torch.randn(B, hq, nq, d, device="cuda", dtype=dt)
    k, v = (torch.randn(B, hkv, L, d, device="cuda", dtype=dt) for _ in range(2))
    nbytes = 2 * B * hkv * L * d * q.element_size() + 2 * q.numel() * q.element_size()
    row = {"B": B, "hq": hq, "hkv": hkv, "nq": nq, "L": L, "d": d, "dtype": str(dt)[6:], "us": {}}
    mask = None
    if nq > 1:  # bottom-right causal: the new tokens see the cache and each other in order
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(nq, L)
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
                fn()
                ms, _ = timer(fn)
            row["us"][name] = ms * 1e3
        except Exception as e:  # noqa: BLE001
            row["us"][name] = repr(e)[:60]
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    kw = {"causal": "bottom_right"} if nq > 1 else {}
    ref = cuflash.attention(qc, kc, vc, **kw).astype(cp.float32)
    ms, _ = timer(lambda: cuflash.attention(qc, kc, vc, **kw))
    row["us"]["api"] = ms * 1e3
    row["path"] = repr(cuflash.prepare_attention(qc, kc, vc, **kw))[:200]
    p = validate_forward(qc, kc, vc, causal="bottom_right" if nq > 1 else False)
    o4 = cp.empty_like(qc)
    lse3 = cp.empty((B, hq, nq), dtype=cp.float32)
    if SWEEP == "few":  # (name, tile, splits, cluster): the table's tile, splits filling 2 (d=128) or 3-4 blocks per SM
        pairs = B * hkv
        if d == 128:
            t0 = T(16, 4, 2)
            fill = max(1, 2 * SMS // pairs)
            variants = [("r0", t0, n, c) for n, c in ((None, None), (fill, False), (min(fill, 8), False), (16, False),
                                                       (24, False), (32, False), (4, None))]
        else:
            t2 = T(16, 2, 2)
            fill3, fill4 = max(1, 3 * SMS // pairs), max(1, 4 * SMS // pairs)
            variants = [("16x4s2", T(16, 4, 2), None, None), ("16x2s2", t2, fill3, False), ("16x2s2", t2, fill4, False),
                        ("16x2s2", t2, 6, False), ("16x2s2", t2, None, None), ("16x2s2r2", T(16, 2, 2, 2), fill3, False)]
    elif SWEEP == "nosplit":  # the no-split tile and the table's, 1-4 splits through memory (last split) or a cluster
        tiles = [("nosplit", schedule.DECODE_TILES_NO_SPLIT[128]), ("table", schedule.DECODE_TILES[128])]
        variants = [(f"{tn}-{m}", t, n, cl, "last") for tn, t in tiles for n, cl, m in
                    ((1, False, "one"), (2, False, "mem"), (3, False, "mem"), (4, False, "mem"), (2, True, "cl"),
                     (4, True, "cl"))]
    elif SWEEP == "wide":  # the planner's split count, merged both ways
        variants = [(m, None, None, False, m) for m in ("last", "kernel")]
    elif SWEEP == "merge":  # the planner's tile; its split count and others, each merged both ways
        variants = [(m, None, n, False, m) for m in ("last", "kernel") for n in (None, 8, 16, 24, 32)]
    else:
        variants = [(tname, tile, n, None) for tname, tile in TILES for n in SPLITS]
    for tname, tile, n, cl, *merge in variants:
            key = f"{tname}/{n or 'auto'}{'' if cl is None else 'c' if cl else 'm'}"
            mg = merge[0] if merge else None
            try:
                lp = gpu_decode.launch_plan(p, SMS, n, tile, cluster=cl)
                f = lambda: gpu_decode.forward(p, qc, kc, vc, o4, lse3, splits=n, tile=tile, cluster=cl, merge=mg)  # noqa: E731
                o4.fill(float("nan"))
                f()
                err = float(cp.abs(o4.astype(cp.float32) - ref).max())
                ms, _ = timer(f)
                row["us"][key] = ms * 1e3 if err < 0.05 else f"wrong {err}"
                key2 = f"{key}[{lp.splits}{'c' if lp.cluster else ''}]"
                row["us"][key2] = row["us"].pop(key)
            except Exception as e:  # noqa: BLE001
                row["us"][key] = repr(e)[:60]
    us = row["us"]
    peers = [us[k_] for k_ in ("cudnn", "flash") if isinstance(us.get(k_), float)]
    best = min(peers) if peers else None
    ranked = sorted((v_, k_) for k_, v_ in us.items() if isinstance(v_, float) and k_ not in ("cudnn", "flash"))
    print(f"B{B} H{hq}/{hkv} nq{nq} L{L} d{d} {row['dtype']}: cudnn {us.get('cudnn')}, flash {us.get('flash')}, api {us['api']:.1f} "
          f"(x best peer {best / us['api']:.3f}, {nbytes / us['api'] / 1e6:.2f} TB/s) | best: "
          + ", ".join(f"{k_} {v_:.1f} x{best / v_:.3f}" for v_, k_ in ranked[:12])
          + " | errors: " + ", ".join(f"{k_}: {v_}" for k_, v_ in us.items() if isinstance(v_, str)), flush=True)
    print("   ", row["path"], flush=True)
    out.append(row)
    del q, k, v, qc, kc, vc, ref
    json.dump(out, open(sys.argv[1], "w"), indent=1)
