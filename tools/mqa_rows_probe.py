"""Row blocks for MQA with many sequences (GPU machine): Hkv=1, Hq=64 at d=64 (the planner's
blocks hold all 64 rows, four row tiles) and d=128 (two blocks of 32 rows), B = 8-128,
L = 2k-16k: the planner against R = 2 / 4 row blocks forced (each block group/R heads, the planner's
splits for them), next to cuDNN and FA2 (torch SDPA; benchmarks.peers.Timer: L2 flushed, launch
hidden), alternating the order; x the faster peer. tools/mqa_batch_probe.py found R=2 ahead at d=64
B=64 L=4k (0.64 -> 0.83) and B=32 L=8k (0.70 -> 0.84), behind at B=128 L=2k (0.73 -> 0.67).

    python3 tools/mqa_rows_probe.py out.json [passes] [check]
"check": Hq = 48 / 64 / 128 at d=64, B = 8 / 32 / 64, L = 4k / 16k, after the planner's rule
(gpu_decode._WIDE_D64_ROWS), against the R it replaced.
"""
import json
import sys

sys.path.insert(0, ".")
from benchmarks.peers import Timer  # noqa: E402
from cuflash import gpu_decode, plan_cache  # noqa: E402

sys.path.insert(0, "tools")
from decode_cells import ProbeCase  # noqa: E402

plan_cache.enabled = False
PASSES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
SHAPES = [(B, 64, L, 64) for B in (8, 16, 32, 64, 128) for L in (2048, 4096, 8192, 16384) if B * L <= 64 * 16384]
SHAPES += [(B, 64, L, 128) for B in (16, 32, 64) for L in (4096, 16384)]
if len(sys.argv) > 3 and sys.argv[3] == "check":
    SHAPES = [(B, hq, L, 64) for hq in (48, 64, 128) for B in (8, 32, 64) for L in (4096, 16384)]
planned = gpu_decode.row_blocks
timer = Timer(warmup=3, repeats=20, seconds_per_impl=0.15)
sms = gpu_decode._sm_count(0)
out = []
for B, hq, L, d in SHAPES:
    case = ProbeCase(L, B, 1, hq, d)
    p = case.p
    r0 = planned(p, sms)
    variants = ["planner"] + [f"R{r}" for r in (1, 2, 4) if r != r0 and hq // r <= 64]

    def forced(name, f):
        """f() with gpu_decode.row_blocks forced to variant `name`'s count (R<r>; "planner": as planned)."""
        if name != "planner":
            gpu_decode.row_blocks = lambda p_, sm_count=None, r=int(name[1:]): r if p_.hkv == 1 else 1
        try:
            return f()
        finally:
            gpu_decode.row_blocks = planned

    def plan():
        try:
            lp = gpu_decode.launch_plan(p, sms)
            return f"R{gpu_decode.launch_problem(p, sms).hkv} {lp.splits}x{lp.chunk} rt{lp.row_tiles}{' cl' if lp.cluster else ''}"
        except Exception as e:  # noqa: BLE001
            return repr(e)[:40]

    plans = {name: forced(name, plan) for name in variants}
    row = {"B": B, "hq": hq, "L": L, "d": d, "plans": plans}
    row["passes"] = case.alternate(timer, {n: lambda n=n: forced(n, lambda: case.forward_us(timer)) for n in variants},
                                   PASSES, f"B{B} H{hq}/1 L{L} d{d}", plans)
    out.append(row)
    case = None  # (frees the shape's GPU buffers before the next one)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
