"""The e4m3 tile search on one Hopper GPU, one process: the e4m3 forward's tiles
(attn_fwd_wgmma_tma_fp8) and the e4m3 KV cache's decode tiles and split counts (attn_decode_kv8),
each candidate timed next to the table's own in the same process on the same inputs.

    PYTHONPATH=. python3 tools/e4m3_search.py --out DIR             # on an sm_90 GPU, ~3 minutes
    PYTHONPATH=. python3 tools/e4m3_search.py --ops decode --out DIR
    PYTHONPATH=. python3 tools/e4m3_search.py --ops fwd --persistent --fwd-dims 128 --rounds 3 --out DIR
    PYTHONPATH=. python3 tools/e4m3_search.py --dry-run             # anywhere: the candidates

forward: d = 128 and 256 at N = 8k and 16k (B x H = 2 x 16 and 1 x 16 at d = 128, 2 x 8 and 1 x 8
at d = 256), causal and not, bf16 out, per-(batch, head) descales; TFLOP/s by the 4 N^2 d
convention (halved when causal), the pass that builds vt included; --persistent: the table's tile
against the persistent kernel's (attn_fwd_wgmma_tma_fp8_persistent) own-pace tiles, with and
without the per-warpgroup epilogue. decode: one bf16 query token
per sequence, Hq = 32, d = 128, e4m3 caches of SHAPES; each tile with the planner's split count
(plan.decode.e4m3_launch's waves where the tile is the table's) and the SPLITS of its shape;
"x_copy" is the cache read rate over the copy rate measured in the same run.

Every candidate's output is compared with the table tile's (max_abs_diff); timings are CUDA events
with L2 flushed between repeats (benchmarks/peers.py's Timer). Writes e4m3_search.json and
e4m3_search.log to --out and prints the three fastest candidates per cell (--rounds R: each cell's
candidates timed R times, the order rotated each round; the median per candidate).
Importable without a GPU: CuPy and torch are imported inside the device path only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuflash.core.arrays import BFLOAT16  # noqa: E402
from cuflash.plan import decode as plan_decode  # noqa: E402
from cuflash.plan import hopper as plan_hopper  # noqa: E402
from cuflash.plan import schedule  # noqa: E402
from cuflash.plan.schedule import DecodeTile, HopperTile  # noqa: E402

OPS = ("fwd", "decode")
FWD_SHAPES = {128: ((2, 16, 8192), (1, 16, 16384)), 256: ((2, 8, 8192), (1, 8, 16384))}  # (B, H, N)
SHAPES = ((8, 8, 16384), (8, 8, 65536), (64, 8, 16384), (8, 32, 16384), (1, 8, 131072))  # (B, Hkv, L), Hq = 32
# Explicit (splits, cluster) per (B, Hkv) besides the planner's count.
SPLITS = {(8, 8): ((4, False), (8, True), (8, False), (16, False)), (64, 8): ((2, False), (2, True)),
          (8, 32): ((2, False), (2, True)), (1, 8): ((16, False), (33, False), (49, False), (64, False))}
SMEM_LIMIT = 232448 - 1024  # an sm_90 block's opt-in shared memory, less the swizzle alignment


def fwd_candidates(hd: int, persistent: bool = False) -> list[HopperTile]:
    """128-256-key tiles (whole k32 steps; vt's slot whole 128-key boxes), 2-4 stages, that fit
    shared memory: per tile, ping-pong or not; or (persistent) own pace, each warpgroup storing its
    own rows or not."""
    out = []
    for block_n in plan_hopper.FP8_KEY_TILES:
        for stages in (2, 3, 4):
            for flag in (False, True):
                t = (HopperTile(block_n, 2, stages, "search", tma=True, persistent=True, wg_epilogue=flag)
                     if persistent else HopperTile(block_n, 2, stages, "search", tma=True, pingpong=flag))
                if t.smem_bytes(hd, 1) <= SMEM_LIMIT:
                    out.append(t)
    return out


def decode_candidates() -> list[DecodeTile]:
    """d = 128 e4m3 tiles: 16-64 keys, 4 or 8 warps, 2-8 stages, rings 0-2 (the block copies; ring 1
    up to 4 stages, or 8 warps at 2)."""
    shapes = {0: ((16, 4, 4), (16, 4, 8), (32, 4, 2), (32, 4, 4), (16, 8, 4), (64, 4, 2)),
              1: ((16, 4, 4), (32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (16, 8, 2), (32, 8, 2)),
              2: ((16, 4, 4), (32, 4, 2), (32, 4, 4))}
    return [DecodeTile(bn, warps, stages, 2, "search", ring=ring, kv_bytes=1)
            for ring, tiles in shapes.items() for bn, warps, stages in tiles]


def candidate_specs(ops=OPS, persistent=False, dims=tuple(FWD_SHAPES)):
    """Every instantiation the search launches (bf16) for `ops`, for the parallel compile."""
    specs = [plan_decode._kernel_spec(BFLOAT16, 128, 1, t, False, True, cluster)
             for t in decode_candidates() for cluster in (0, *plan_decode.CLUSTER_SIZES)] if "decode" in ops else []
    specs += [plan_hopper.fp8_forward_spec(BFLOAT16, hd, causal, t)[0]
              for hd in dims for causal in (False, True)
              for t in [schedule.fp8_forward_tile(hd, causal), *forward_tiles(hd, causal, persistent)]] if "fwd" in ops else []
    return list(dict.fromkeys(specs))


def forward_tiles(hd: int, causal: bool, persistent=False) -> list:
    """The tiles timed beside the dispatch's for (hd, causal): the candidates and, where the dispatch
    runs a persistent tile, the per-tile table's tile, so that the per-tile kernel stays the yardstick."""
    cands = fwd_candidates(hd, persistent)
    per_tile = schedule.HOPPER_FP8_FORWARD_TILES[hd]
    runs_persistent = schedule.fp8_forward_tile(hd, causal).persistent
    return ([per_tile] if runs_persistent and not any(same_tile(per_tile, c) for c in cands) else []) + cands


def same_tile(a, b) -> bool:
    """a and b launch the same kernel and geometry (their reasons aside)."""
    return dataclasses.replace(a, reason="") == dataclasses.replace(b, reason="")


def label(t) -> str:
    if isinstance(t, HopperTile):
        kind = (" persistent" + (" wg-epilogue" if t.wg_epilogue else "")) if t.persistent else ""
        return f"{t.block_m}x{t.block_n} s{t.stages}{' pp' if t.pingpong else ''}{kind}"
    return f"{t.block_n}x{t.warps}w s{t.stages} r{t.ring}"


def dry_run(persistent=False, dims=tuple(FWD_SHAPES)) -> int:
    for hd in dims:
        table, causal = schedule.fp8_forward_tile(hd, False), schedule.fp8_forward_tile(hd, True)
        others = [label(t) for t in fwd_candidates(hd, persistent) if not same_tile(t, table)]
        also = "" if same_tile(causal, table) else f" (causal: {label(causal)})"
        print(f"fwd d={hd}: table {label(table)}{also}; others", ", ".join(others))
    table = schedule.DECODE_TILES_KV8[128]
    others = [label(t) for t in decode_candidates() if not same_tile(t, table)]
    print(f"decode d=128: table {label(table)}; others", ", ".join(others))
    for (b, hkv), splits in SPLITS.items():
        print(f"  B={b} Hkv={hkv}: splits " + ", ".join(f"{n} ({'cluster' if c else 'memory'})" for n, c in splits))
    print(f"{len(candidate_specs(persistent=persistent, dims=dims))} instantiations")
    return 0


class Search:
    def __init__(self, out: Path, budget_s: float, ops=OPS, persistent=False, rounds=1, dims=tuple(FWD_SHAPES)):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import cupy
        import torch
        from peers import Timer, measure_ceilings, quantize_e4m3, torch_stream_ptr

        import cuflash
        from cuflash.api.interop import external_stream

        self.cupy, self.torch, self.cuflash, self.quantize = cupy, torch, cuflash, quantize_e4m3
        self.stream = lambda: external_stream(torch_stream_ptr(), cupy.cuda.Device().id)
        self.timer = Timer(2, 20, 0.15)
        self.start, self.budget = time.monotonic(), budget_s
        self.ops, self.persistent, self.rounds, self.dims = ops, persistent, rounds, dims
        self.log_file = open(out / "e4m3_search.log", "w")
        self.ceilings = measure_ceilings(self.timer)
        self.log(f"ceilings {self.ceilings}")

    def log(self, msg):
        line = f"[{time.monotonic() - self.start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def spent(self, share=1.0) -> bool:
        return time.monotonic() - self.start > self.budget * share

    def as_cupy(self, t):
        with self.stream():
            return self.cupy.from_dlpack(t)

    def time_candidate(self, fn, ref):
        """(ms, max |out - ref|, out as float32) of fn, or an exception."""
        def run():
            with self.stream():
                return fn()
        out = run().astype(self.cupy.float32)
        diff = 0.0 if ref is None else float(self.cupy.abs(out - ref).max())
        ms, _ = self.timer(run)
        return ms, diff, out

    def forward(self, rows):
        for hd in self.dims:
            for b, h, n in FWD_SHAPES[hd]:
                self.forward_shape(rows, hd, b, h, n)
                self.free()

    def forward_shape(self, rows, hd, b, h, n):
        torch = self.torch
        torch.manual_seed(0)
        quantized = [self.quantize(torch.randn(b, h, n, hd, device="cuda", dtype=torch.bfloat16)) for _ in "qkv"]
        args = [self.as_cupy(x8.view(torch.uint8)) for x8, _ in quantized]
        descales = {name: self.as_cupy(ds) for name, (_, ds) in zip(("q_descale", "k_descale", "v_descale"), quantized)}
        per_tile, persistent = schedule.HOPPER_FP8_FORWARD_TILES[hd], dict(schedule.HOPPER_FP8_FORWARD_PERSISTENT)
        for causal, r in ((c, r) for c in (False, True) for r in range(self.rounds)):
            table = schedule.fp8_forward_tile(hd, causal)  # (the tile the dispatch runs)
            candidates = [table] + [c for c in forward_tiles(hd, causal, self.persistent) if not same_tile(c, table)]
            ref = None
            for t in candidates[r % len(candidates):] + candidates[:r % len(candidates)]:
                if self.spent(0.45 if "decode" in self.ops else 0.95):
                    return
                schedule.HOPPER_FP8_FORWARD_TILES[hd] = t  # (run as the plain kernel's tile)
                schedule.HOPPER_FP8_FORWARD_PERSISTENT.clear()
                try:
                    ms, diff, out = self.time_candidate(
                        lambda: self.cuflash.attention(*args, causal=causal, **descales), ref)
                except Exception as exc:  # noqa: BLE001 - a failing candidate is a log line
                    self.log(f"fwd d={hd} N={n} {label(t)}: {exc!r}"[:300])
                    continue
                finally:
                    schedule.HOPPER_FP8_FORWARD_TILES[hd] = per_tile
                    schedule.HOPPER_FP8_FORWARD_PERSISTENT.update(persistent)
                ref = out if ref is None else ref
                flops = 4 * b * h * n * n * hd / (2 if causal else 1)
                rows.append(dict(op="fwd", d=hd, b=b, h=h, n=n, causal=causal, tile=label(t), table=t is table,
                                 round=r, ms=ms, tflops=flops / ms / 1e9, max_abs_diff=diff))

    def decode(self, rows, shapes=SHAPES):
        for b, hkv, n in shapes:
            self.decode_shape(rows, b, hkv, n)
            self.free()

    def decode_shape(self, rows, b, hkv, n):
        torch, cuda_backend = self.torch, sys.modules["cuflash.backends.cuda"]
        table = schedule.DECODE_TILES_KV8[128]
        plain = cuda_backend.decode
        torch.manual_seed(0)
        q = self.as_cupy(torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16))
        (k8, kd), (v8, vd) = (self.quantize(torch.randn(b, hkv, n, 128, device="cuda", dtype=torch.bfloat16))
                              for _ in "kv")
        k, v = self.as_cupy(k8.view(torch.uint8)), self.as_cupy(v8.view(torch.uint8))
        kd, vd = self.as_cupy(kd.contiguous()), self.as_cupy(vd.contiguous())
        cache_bytes = 2 * b * hkv * n * 128 + 2 * 2 * b * 32 * 128
        others = [t for t in decode_candidates() if not same_tile(t, table)]
        configs = ([(None, None, None)] + [(table, s, c) for s, c in SPLITS[(b, hkv)]]
                   + [(t, s, c) for t in others for s, c in ((None, None),) + SPLITS[(b, hkv)]])
        ref = None
        for t, splits, cluster in configs:
            if self.spent():
                return
            forced = {key: x for key, x in (("tile", t), ("splits", splits), ("cluster", cluster)) if x is not None}
            cuda_backend.decode = lambda *a, **kw: plain(*a, **{**kw, **forced})
            try:
                ms, diff, out = self.time_candidate(lambda: self.cuflash.attention(q, k, v, k_descale=kd, v_descale=vd),
                                                    ref)
            except Exception as exc:  # noqa: BLE001
                self.log(f"decode B={b} Hkv={hkv} L={n} {label(t or table)} splits={splits}: {exc!r}"[:300])
                continue
            finally:
                cuda_backend.decode = plain
            ref = out if ref is None else ref
            tbps = cache_bytes / ms / 1e9
            rows.append(dict(op="decode", b=b, hq=32, hkv=hkv, n=n, tile=label(t or table),
                             table=t is None or same_tile(t, table), splits=splits, cluster=cluster, ms=ms, tbps=tbps,
                             x_copy=tbps / self.ceilings["copy_tbps"], max_abs_diff=diff))

    def free(self):
        self.cupy.get_default_memory_pool().free_all_blocks()
        self.torch.cuda.empty_cache()


def split_label(row) -> str:
    if row.get("splits") is None:
        return ""
    return f" splits={row['splits']} ({'cluster' if row['cluster'] else 'memory'})"


def best_lines(rows):
    """The three fastest candidates per cell (each candidate's median over rounds), as ratios to the
    table tile's time."""
    cells = {}
    for r in rows:
        key = (r["op"], r.get("d", r.get("b")), r.get("hkv"), r["n"], r.get("causal"))
        cand = cells.setdefault(key, {}).setdefault((r["tile"], r.get("splits"), r.get("cluster")), [])
        cand.append(r)
    lines = []
    for key, by_candidate in cells.items():
        rs = []
        for runs in by_candidate.values():  # the median run of each candidate
            rs.append(sorted(runs, key=lambda r: r["ms"])[len(runs) // 2])
        base = next((r for r in rs if r["table"] and r.get("splits") is None), rs[0])
        top = sorted(rs, key=lambda r: r["ms"])[:3]
        lines.append(f"{key}: table {base['ms']:.4f} ms; " + "; ".join(
            f"{r['tile']}{split_label(r)} x{base['ms'] / r['ms']:.3f}" for r in top))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output directory (device run)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new candidates after this")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--decode-shapes", default=None,
                    help="decode shapes B,Hkv,L separated by ';' (default: all of SHAPES)")
    ap.add_argument("--persistent", action="store_true",
                    help="forward: the table's tile against the persistent kernel's tiles")
    ap.add_argument("--rounds", type=int, default=1, help="forward: times each cell's candidates are timed")
    ap.add_argument("--fwd-dims", default=",".join(map(str, FWD_SHAPES)), help="forward head dims")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    dims = tuple(int(x) for x in args.fwd_dims.split(","))
    if args.dry_run:
        return dry_run(args.persistent, dims)
    if not args.out:
        ap.error("--out is required for a device run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tools"))
    from schedule_search import _precompile

    ops = args.ops.split(",")
    search = Search(out, args.budget_s, ops, args.persistent, args.rounds, dims)
    shapes = (tuple(tuple(int(x) for x in s.split(",")) for s in args.decode_shapes.split(";"))
              if args.decode_shapes else SHAPES)
    _precompile(candidate_specs(ops, args.persistent, dims), args.workers, search.log)
    rows = []
    try:
        if "fwd" in ops:
            search.forward(rows)
        if "decode" in ops:
            search.decode(rows, shapes)
    finally:
        (out / "e4m3_search.json").write_text(json.dumps({"ceilings": search.ceilings, "rows": rows}, indent=1))
        for line in best_lines(rows):
            search.log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
