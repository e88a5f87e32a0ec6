"""The wide-rows rule against the table's tile (GPU machine): shapes with more than two row tiles of
packed rows per K/V head (MQA with Hq >= 48, or GQA with nq = 16 tokens), d = 64 / 128, B = 1-128,
L = 2k-128k. Variants: the planner as it is ("rule": gpu_decode.planner_tile), the planner with the
rule off ("table": CUFLASH_DECODE_WIDE_ROWS=0), and the wide-rows tile forced ("wide", its own split
count); next to cuDNN and FA2 (torch SDPA) each pass (benchmarks.peers.Timer: L2 flushed, launch
hidden), alternating the order; x = the faster peer's time / the variant's.

    python3 tools/wide_rows_probe.py out.json [passes] [short | steps]
"short": the shapes whose splits are short (_short_blocks: the rule keeps the table's tile), B = 1-8;
also the wide tile at twice its own split count ("wide-x2"). "list": the shapes in PROBE_SHAPES
("B,Hq,Hkv,nq,L,d;..."), the planner against the table's tile. "ring4": the table's wide tile (ring 3)
against ring 4 (FA2's order: DECODE_TILES_WIDE_ROWS_LONG at d=128, 128-key steps; at d=64 a tile of the
same 128-key steps in one buffer), also at ring 3's split count, and the planner as the environment sets
it (CUFLASH_DECODE_WIDE_LONG=1: ring 4 for long splits).
"steps": MQA shapes the rule sends wide, against wide tiles of twice the keys per step (FA2 steps 128
keys at d=128): 2x key tiles, or 8 warps (half of them only copy); both one block per SM.
"""
import dataclasses
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache, schedule  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SHAPES = [  # (B, Hq, Hkv, nq, L, d)
    (1, 64, 1, 1, 131072, 128), (2, 64, 1, 1, 16384, 128), (4, 64, 1, 1, 16384, 128), (8, 64, 1, 1, 32768, 128),
    (16, 48, 1, 1, 8192, 128), (16, 128, 1, 1, 8192, 128), (64, 64, 1, 1, 16384, 128), (8, 32, 8, 16, 4096, 128),
    (4, 128, 1, 1, 8192, 64), (16, 64, 1, 1, 16384, 64), (32, 128, 1, 1, 4096, 64), (128, 64, 1, 1, 2048, 64),
    (64, 48, 1, 1, 16384, 64), (64, 128, 1, 1, 16384, 64), (8, 32, 8, 16, 8192, 64),
]
MODE = sys.argv[3] if len(sys.argv) > 3 else ""
if MODE == "steps":
    SHAPES = [(8, 64, 1, 1, 32768, 128), (64, 64, 1, 1, 16384, 128), (16, 128, 1, 1, 8192, 128),
              (16, 64, 1, 1, 16384, 64), (64, 128, 1, 1, 16384, 64)]
if MODE == "short":
    SHAPES = [(1, 48, 1, 1, 32768, 128), (2, 48, 1, 1, 16384, 128), (2, 48, 1, 1, 32768, 128), (1, 64, 1, 1, 32768, 128),
              (2, 64, 1, 1, 16384, 128), (3, 64, 1, 1, 16384, 128), (4, 64, 1, 1, 8192, 128), (4, 64, 1, 1, 16384, 128),
              (6, 64, 1, 1, 8192, 128), (1, 128, 1, 1, 16384, 128), (2, 128, 1, 1, 8192, 128),
              (2, 64, 1, 1, 16384, 64), (3, 64, 1, 1, 8192, 64), (4, 64, 1, 1, 16384, 64), (2, 128, 1, 1, 8192, 64),
              (4, 48, 1, 1, 8192, 64), (1, 128, 1, 1, 32768, 64), (1, 64, 1, 1, 32768, 64)]
if MODE == "ring4":  # (d=128: ring 3's 64-key steps in two stages against ring 4, FA2's order with 128-key steps)
    SHAPES = [(8, 64, 1, 1, 32768, 128), (64, 64, 1, 1, 16384, 128), (16, 128, 1, 1, 8192, 128), (16, 48, 1, 1, 8192, 128),
              (32, 64, 1, 1, 16384, 128), (4, 64, 1, 1, 16384, 128), (2, 48, 1, 1, 32768, 128), (8, 32, 8, 16, 4096, 128),
              (1, 64, 1, 1, 131072, 128),
              # d=64: ring 3's 128-key steps in two stages against ring 4 with one buffer of the same
              # steps (compiled at run time: 168 registers, 40 KiB; 256-key steps spilled)
              (16, 64, 1, 1, 16384, 64), (8, 64, 1, 1, 16384, 64), (64, 48, 1, 1, 16384, 64), (64, 128, 1, 1, 16384, 64),
              (32, 128, 1, 1, 4096, 64)]
if MODE == "list":  # (PROBE_SHAPES="B,Hq,Hkv,nq,L,d;...": the planner against the table's tile only)
    import os
    SHAPES = [tuple(int(x) for x in sh.split(",")) for sh in os.environ["PROBE_SHAPES"].split(";")]
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.2)
sms = gpu_decode._sm_count(0)
out = []


def run(case, rule, kw):
    gpu_decode.WIDE_ROWS_AUTO = rule
    try:
        return case.forward_us(timer, **kw)
    finally:
        gpu_decode.WIDE_ROWS_AUTO = True


for B, hq, hkv, nq, L, d in SHAPES:
    case = ProbeCase(L, B, hkv, hq, d, nq)
    p = case.p
    wide = schedule.DECODE_TILES_WIDE_ROWS[d]
    variants = {"rule": (True, {}), "table": (False, {}), "wide": (True, dict(tile=wide))}
    if MODE == "list":
        variants = {"rule": (True, {}), "table": (False, {})}
    if MODE == "ring4":  # (ring 3: the table's wide tile; ring 4: DECODE_TILES_WIDE_ROWS_LONG's, or at d=64 one)
        ring4 = schedule.DECODE_TILES_WIDE_ROWS_LONG.get(d) or schedule.DecodeTile(32, 4, 1, 4, "d=64 ring 4", ring=4)
        own3 = gpu_decode.launch_plan(p, sms, tile=wide).splits
        variants = {"ring3": (True, dict(tile=wide)), "ring4": (True, dict(tile=ring4)),
                    "ring4-s3": (True, dict(tile=ring4, splits=own3)),
                    "api-long": (True, {})}  # (the planner with CUFLASH_DECODE_WIDE_LONG as set)
    if MODE == "steps":  # (compiled at run time: not in the table)
        variants = {"rule": (True, {}), "wide-2n": (True, dict(tile=dataclasses.replace(wide, block_n=2 * wide.block_n))),
                    "wide-8w": (True, dict(tile=dataclasses.replace(wide, warps=8)))}
    if MODE == "short":  # (twice the wide tile's own splits: its key bound held them down)
        own = gpu_decode.launch_plan(p, sms, tile=wide).splits
        variants["wide-x2"] = (True, dict(tile=wide, splits=2 * own))
    plans = {}
    for name, (rule, kw) in variants.items():
        gpu_decode.WIDE_ROWS_AUTO = rule
        lp = gpu_decode.launch_plan(p, sms, **kw)
        plans[name] = f"{lp.splits}x{lp.chunk} rt{lp.row_tiles} ring{lp.tile.ring}{' cl' if lp.cluster else ''}"
    gpu_decode.WIDE_ROWS_AUTO = True
    row = {"B": B, "hq": hq, "hkv": hkv, "nq": nq, "L": L, "d": d, "plans": plans}
    row["passes"] = case.alternate(timer, {n: lambda rule=rule, kw=kw: run(case, rule, kw)
                                           for n, (rule, kw) in variants.items()},
                                   PASSES, f"B{B} H{hq}/{hkv} nq{nq} L{L} d{d}", plans)
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
