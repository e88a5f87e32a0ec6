"""The tile schedule search on one GPU (written for the H200), one process.

For d in {64, 128, 256} and N in {1k, 4k, 16k} (B*N = 16384 tokens, H*d = 2048, bfloat16), causal
and not, for both kernel families of the forward and of the backward's K/V kernel ("fwd" and
"bwd": mma.sync, every d; "fwd_wgmma" and "bwd_wgmma": the Hopper wgmma kernels, for the head
dims of their Hopper tables (bwd_wgmma: 64 and 128), skipped on other GPUs): every candidate on a short list (the built-in table's tile, the largest
legal tile, then diverse block shapes, PER_BUCKET per (op, d); see cuflash.plan.tuning.shortlist; for
bwd_wgmma every legal one) that
compiles without spilling is run once, compared with torch SDPA's flash output (max abs diff;
a candidate further off than twice the table's own difference, or one bfloat16 rounding of the
largest value, is skipped as a mismatch), and timed with CUDA events (median, 256 MiB written
between repeats to flush L2). Writes three files to --out DIR: schedule_search.json (everything),
schedule_search.md (a section per op, a table per head dim: the fastest config, the largest legal
tile, their times, registers and occupancy, next to the table's tile and torch's flash kernel) and
schedule_search.log (the progress log).

    PYTHONPATH=. python3 tools/schedule_search.py --out $OUT          # on the GPU, <= ~5 minutes
    PYTHONPATH=. python3 tools/schedule_search.py --ops fwd_wgmma,bwd_wgmma --ds 64,128 --out $OUT  # ~1 minute
    PYTHONPATH=. python3 tools/schedule_search.py --dry-run           # anywhere: the candidate lists

Importable without a GPU: CuPy and torch are imported inside the device path only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuflash.plan import device_limits
from cuflash.plan import schedule
from cuflash.autotune import backward_tile_kwargs
from cuflash.plan.device_limits import occupancy
from cuflash.plan.tuning import (FORWARD_OPS, HOPPER_OPS, OP_TITLE, Candidate, candidates, estimated_registers, largest_first,
                                likely_spills, op_buckets, shortlist, table_tile)

TOKENS = 16384
HIDDEN = 2048
DS = (64, 128, 256)
NS = (1024, 4096, 16384)
OPS = ("fwd", "fwd_wgmma", "bwd", "bwd_wgmma")
# Clean candidates timed per (op, d), plus the largest. The wgmma forward gets more: its forward
# timings are cheap (milliseconds) and its space has stage variants as well as block shapes. The
# wgmma backward's whole space is 9 tiles, of which 4-5 are legal: all of them.
PER_BUCKET = {"fwd": 6, "fwd_wgmma": 12, "bwd": 6, "bwd_wgmma": 9}
BF16_U = 2.0**-8  # unit roundoff of bfloat16
LARGEST_TRIES = 16  # largest-first candidates compiled to find the largest that does not spill
ORDER_TRIES = 3  # try at most 3 x per_bucket candidates of the short list to find per_bucket clean ones


def planned_shapes(ds=DS, ns=NS):
    """[(d, N, B, H)]: B*N = 16384 tokens and H*d = 2048 for every shape."""
    return [(d, n, TOKENS // n, HIDDEN // d) for d in ds for n in ns]


def plan(ops=OPS, ds=DS, per_bucket=None, limits=None):
    """{(op, d): {"order": [Candidate...] in try order, "largest": [Candidate...] largest first}}.

    The device run walks "order" until per_bucket (default PER_BUCKET[op]) candidates compile
    cleanly, and "largest" until one does (the largest legal tile); both lists contain only
    statically legal candidates. (op, d) pairs the kernel never runs for (bwd_wgmma at d=256) are
    left out."""
    limits = limits or device_limits.H200
    out = {}
    for op in ops:
        for d in ds:
            hd = schedule.head_dim_bucket(d)
            if hd not in op_buckets(op):
                continue
            cands = candidates(op, hd)
            out[(op, d)] = {
                "order": shortlist(cands, None, limits, table_tile(op, hd)),
                "largest": largest_first(cands, limits),
                "per_bucket": per_bucket or PER_BUCKET.get(op, 6),
            }
    return out


def print_plan(pl, limits, shapes, file=sys.stdout):
    print(f"limits: {limits.name}: {limits.smem_per_block_optin} B smem/block (opt-in), {limits.regs_per_sm} regs/SM",
          file=file)
    print("shapes (d, N, B, H): " + ", ".join(str(s) for s in shapes) + "; causal and not; bfloat16", file=file)
    for (op, d), entry in pl.items():
        k = entry["per_bucket"]
        print(f"\n{op} d={d}: {len(entry['order'])} legal; tried in this order until {k} compile without spills:",
              file=file)
        for i, c in enumerate(entry["order"][: 2 * k]):
            occ = occupancy(limits, c.threads, min(estimated_registers(c), 255), c.smem_bytes)
            flag = " (likely spills)" if likely_spills(c, limits) else ""
            print(f"  {i + 1:2d}. {c.name:14s} threads {c.threads:4d} smem {c.smem_bytes:7d} B  "
                  f"est. regs {estimated_registers(c):3d} -> ~{occ.blocks_per_sm} blocks/SM{flag}", file=file)
        print("  largest legal tile: first clean of " + ", ".join(c.name for c in entry["largest"][:4]) + ", ...",
              file=file)


# --------------------------------------------------------------------------- device run


class Budget:
    def __init__(self, seconds):
        self.t0 = time.monotonic()
        self.seconds = seconds

    @property
    def elapsed(self):
        return time.monotonic() - self.t0

    def spent(self):
        return self.elapsed > self.seconds


def _warm_one(source, expression):
    """Worker process: compile one kernel with CuPy exactly as cuflash.kernels.build.get_function does,
    which stores the cubin in CuPy's on-disk cache (name expressions included, CuPy >= 14)."""
    import cupy

    from cuflash.kernels import build

    t0 = time.monotonic()
    try:
        cc = int(cupy.cuda.Device().compute_capability)
        mod = cupy.RawModule(code=build.load_source(source), options=build.arch_options(cc),
                             name_expressions=(expression,))
        mod.get_function(expression)
        return expression, None, time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the serial compile afterwards reports it properly
        return expression, repr(exc)[:200], time.monotonic() - t0


def _precompile(specs, workers, log):
    """Warm CuPy's compile cache for specs in parallel processes (NVRTC is CPU bound); any failure
    here is only logged: the serial get_function afterwards compiles again and reports it."""
    import concurrent.futures as cf
    import multiprocessing as mp

    try:
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
            futures = [ex.submit(_warm_one, s.source, s.expression) for s in specs]
            failed = sum(f.result()[1] is not None for f in cf.as_completed(futures))
        log(f"precompiled {len(specs)} kernels ({failed} failed to compile)")
    except Exception as exc:  # noqa: BLE001 - e.g. no process support: fall back to compiling serially
        log(f"precompile skipped: {exc!r}")


def _compile_info(cand, causal, info_cache):
    """CompileInfo of one instantiation (bfloat16, vectorized), compiled once per run."""
    from cuflash.core.arrays import BFLOAT16
    from cuflash.autotune import compile_device_info
    from cuflash.plan.tuning import spec_for

    spec = spec_for(cand, BFLOAT16, causal)
    if spec not in info_cache:
        info_cache[spec] = compile_device_info(spec)
    return info_cache[spec]


def _record(info):
    return {"registers": info.registers, "spill_bytes": info.spill_bytes, "error": info.error, "clean": info.clean}


def select_candidates(entry, info_cache, budget, log):
    """(chosen, largest, records) for one (op, d), screened on the non-causal instantiation:
    the first per_bucket candidates of the try order that compile without spilling, plus the
    largest tile that does. records: name -> [non-causal record] (causal added later)."""
    records = {}

    def clean(c):
        if c.name not in records:
            info = _compile_info(c, False, info_cache)
            records[c.name] = [_record(info)]
            log(f"  compile {c.name}: {info.registers} regs, {info.spill_bytes} B spilled"
                + (f", error {info.error}" if info.error else ""))
        return records[c.name][0]["clean"]

    chosen = []
    k = entry["per_bucket"]
    for c in entry["order"][:ORDER_TRIES * k]:
        if len(chosen) >= k or budget.spent():
            break
        if clean(c):
            chosen.append(c)
    largest = None
    for c in entry["largest"][:LARGEST_TRIES]:
        if budget.spent():
            break
        if clean(c):
            largest = c
            break
    if largest is not None and all(c.name != largest.name for c in chosen):
        chosen.append(largest)
    return chosen, largest, records


def _tflops(op, b, h, n, d, causal, seconds):
    """Peers' dense-equivalent convention (docs/accounting.md): 4*B*H*N^2*d, halved causal, x2.5 backward."""
    f = 4 * b * h * n * n * d / (2 if causal else 1) * (1 if op in FORWARD_OPS else 2.5)
    return f / seconds / 1e12


def run_shape(op, d, n, b, h, causal, chosen, flush, budget, log):
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cuflash.autotune import cuda_median_time, forward_launcher
    from cuflash.backends import cuda
    from cuflash.core.problem import validate_forward

    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs, recorded for a replay
    torch.manual_seed(seed)
    shape = (b, h, n, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    p = validate_forward(qc, kc, vc, causal=causal)
    row = {"d": d, "n": n, "b": b, "h": h, "causal": causal, "seed": seed, "candidates": {}}

    def torch_time(fn):
        return cuda_median_time(fn, warmup=2, repeats=10, flush=flush, max_total_s=1.5)

    o_t = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    lse_t = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
    o4, lse3 = cp.from_dlpack(o_t), cp.from_dlpack(lse_t)
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def torch_reference(backend):
        with sdpa_kernel([backend]):
            if op in FORWARD_OPS:
                refs = [F.scaled_dot_product_attention(q, k, v, is_causal=causal)]
                secs = torch_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                return refs, secs
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            o_ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            refs = list(torch.autograd.grad(o_ref, (qg, kg, vg), do, retain_graph=True))
            secs = torch_time(lambda: torch.autograd.grad(o_ref, (qg, kg, vg), do, retain_graph=True))
            return refs, secs

    # torch's flash kernel is the comparison; should it refuse a shape, its memory-efficient one.
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            refs, row["torch_flash_s"] = torch_reference(backend)
            row["torch_backend"] = backend.name
            break
        except RuntimeError as exc:
            row.setdefault("torch_errors", []).append(repr(exc)[:200])
    else:
        raise RuntimeError(f"no torch SDPA reference for {shape}: {row['torch_errors']}")
    if op not in FORWARD_OPS:
        # cuflash's own forward (the table's tile) gives the o and lse the backward reads.
        cuda.forward(p, qc, kc, vc, o4, lse3, tile=schedule.forward_tile(d)[1])
        doc = cp.from_dlpack(do)
        grads_t = [torch.empty_like(x) for x in (q, k, v)]
        grads = [cp.from_dlpack(g) for g in grads_t]
    ref_max = [x.float().abs().max().item() for x in refs]

    forward = forward_launcher(op)

    def run(cand):
        if op in FORWARD_OPS:
            forward(p, qc, kc, vc, o4, lse3, tile=cand.tile)
        else:
            cuda.backward(p, doc, qc, kc, vc, o4, lse3, *grads, **backward_tile_kwargs(op, cand.tile))

    outs = [o_t] if op in FORWARD_OPS else grads_t
    table = table_tile(op, schedule.head_dim_bucket(d))
    table_name = Candidate(op, schedule.head_dim_bucket(d), table).name
    # The table's tile first: its difference from torch sets the mismatch threshold.
    ordered = sorted(chosen, key=lambda c: c.name != table_name)
    tol = None
    for cand in ordered:
        rec = row["candidates"].setdefault(cand.name, {})
        if budget.spent():
            rec["status"] = "not timed (budget)"
            continue
        try:
            for t in outs:
                t.fill_(float("nan"))
            run(cand)
            torch.cuda.synchronize()
            diffs = [(a.float() - r.float()).abs().max().item() for a, r in zip(outs, refs)]
        except Exception as exc:  # noqa: BLE001 - recorded, the search goes on
            rec.update(status="launch failed", error=repr(exc)[:300])
            continue
        rec["max_abs_diff"] = diffs
        if tol is None:
            # (a non-finite table result must not make the threshold NaN, which passes everything)
            base = [x if cand.name == table_name and math.isfinite(x) else 0.0 for x in diffs]
            tol = [2 * max(bd, BF16_U * m) for bd, m in zip(base, ref_max)]
            row["tolerance"] = tol
        if any(not math.isfinite(x) or x > t for x, t in zip(diffs, tol)):
            rec["status"] = "mismatch"
            log(f"    {cand.name}: MISMATCH diff {diffs} > tol {tol}")
            continue
        try:
            secs = cuda_median_time(lambda: run(cand), warmup=2, repeats=10, flush=flush, max_total_s=1.5)
        except Exception as exc:  # noqa: BLE001
            rec.update(status="timing failed", error=repr(exc)[:300])
            continue
        rec.update(status="ok", time_s=secs, tflops=_tflops(op, b, h, n, d, causal, secs))
    return row


def screen(pl, args, budget, log):
    """Compile and screen every (op, d): {(op, d): (chosen, largest, records)}, records holding
    [non-causal, causal] compile records for the chosen candidates."""
    from cuflash.core.arrays import BFLOAT16
    from cuflash.plan.tuning import spec_for

    def warm(cands, causal):
        # CuPy's compile cache warmed in parallel; the serial compiles afterwards are cache hits.
        specs = list(dict.fromkeys(spec_for(c, BFLOAT16, causal) for c in cands))
        if args.workers > 0 and specs:
            log(f"precompiling {len(specs)} {'causal' if causal else 'non-causal'} kernels in {args.workers} processes")
            _precompile(specs, args.workers, log)

    warm([c for e in pl.values() for c in e["order"][:ORDER_TRIES * e["per_bucket"]] + e["largest"][:LARGEST_TRIES]],
         False)
    info_cache, selected = {}, {}
    for (op, d), entry in pl.items():
        log(f"{op} d={d}: screening candidates (non-causal compile)")
        selected[(op, d)] = select_candidates(entry, info_cache, budget, log)
    warm([c for chosen, _, _ in selected.values() for c in chosen], True)
    for chosen, _, records in selected.values():
        for c in chosen:
            records[c.name].append(_record(_compile_info(c, True, info_cache)))
    return selected


def bucket_record(op, d, chosen, largest, records, limits):
    compile_ = {name: {"registers": [r["registers"] for r in recs], "spill_bytes": [r["spill_bytes"] for r in recs],
                       "clean": [r["clean"] for r in recs], "error": next((r["error"] for r in recs if r["error"]), None)}
                for name, recs in records.items()}
    occ = {}
    for c in chosen:
        occ[c.name] = []
        for r in compile_[c.name]["registers"]:
            o = occupancy(limits, c.threads, r, c.smem_bytes)
            occ[c.name].append({"blocks_per_sm": o.blocks_per_sm, "warps_per_sm": o.warps_per_sm, "limiter": o.limiter})
    return {"op": op, "d": d, "chosen": [c.name for c in chosen], "largest": largest.name if largest else None,
            "compile": compile_, "occupancy": occ, "tiles": {c.name: c.fields() for c in chosen}, "shapes": []}


def device_main(args):
    import cupy as cp

    budget = Budget(args.budget_s)
    limits = device_limits.from_cupy()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        lines.append(msg)
        print(f"[{budget.elapsed:6.1f}s] {msg}", flush=True)

    ops = tuple(args.ops.split(","))
    for op in (op for op in HOPPER_OPS if op in ops and limits.cc != 90):
        log(f"{op} skipped: the wgmma kernel needs sm_90; {limits.name} is cc {limits.cc}")
    ops = tuple(op for op in ops if op not in HOPPER_OPS or limits.cc == 90)
    ds = tuple(int(x) for x in args.ds.split(","))
    ns = tuple(int(x) for x in args.ns.split(","))
    pl = plan(ops, ds, args.per_bucket, limits)
    result = {"device": limits.to_dict(), "args": vars(args), "buckets": {}, "budget_s": args.budget_s}
    try:
        selected = screen(pl, args, budget, log)
        flush = cp.empty(256 * 2**20, dtype=cp.uint8)
        for (op, d), (chosen, largest, records) in selected.items():
            bucket = result["buckets"][f"{op}-d{d}"] = bucket_record(op, d, chosen, largest, records, limits)
            for n in ns:
                b, h = TOKENS // n, HIDDEN // d
                for causal in (False, True):
                    if budget.spent():
                        log(f"  budget spent: skipping {op} d={d} N={n} causal={causal}")
                        bucket["shapes"].append({"d": d, "n": n, "b": b, "h": h, "causal": causal, "skipped": "budget"})
                        continue
                    runnable = [c for c in chosen if bucket["compile"][c.name]["clean"][int(causal)]]
                    try:
                        row = run_shape(op, d, n, b, h, causal, runnable, flush, budget, log)
                    except Exception as exc:  # noqa: BLE001 - one broken shape must not lose the rest
                        log(f"  {op} d={d} N={n} causal={causal}: FAILED {exc!r}")
                        bucket["shapes"].append({"d": d, "n": n, "b": b, "h": h, "causal": causal,
                                                 "skipped": f"error: {exc!r}"[:300]})
                        continue
                    for c in chosen:
                        if c not in runnable:
                            row["candidates"][c.name] = {"status": "spills (this mask)"}
                    bucket["shapes"].append(row)
                    ok = {k: v for k, v in row["candidates"].items() if v.get("status") == "ok"}
                    best = min(ok, key=lambda k: ok[k]["time_s"]) if ok else None
                    log(f"  {op} d={d} N={n} causal={causal}: best {best} "
                        + (f"{ok[best]['time_s'] * 1e3:.3f} ms" if best else "")
                        + f" (torch {row['torch_flash_s'] * 1e3:.3f} ms)")
    finally:
        result["elapsed_s"] = budget.elapsed
        result["log"] = lines
        write_outputs(result, out_dir, ops)
    return 0


def _row_cells(op, bucket, row):
    """Markdown cells for one shape: fastest, largest legal tile, table tile, torch."""
    cands = row["candidates"]
    ok = {k: v for k, v in cands.items() if v.get("status") == "ok"}
    best = min(ok, key=lambda k: ok[k]["time_s"]) if ok else None
    largest = bucket["largest"]
    ci = 1 if row["causal"] else 0
    hd = schedule.head_dim_bucket(bucket["d"])
    table_name = Candidate(op, hd, table_tile(op, hd)).name

    def regs(name):
        r = bucket["compile"].get(name, {}).get("registers") if name else None
        return str(r[ci]) if r else "-"

    def occ(name):
        o = bucket.get("occupancy", {}).get(name) if name else None
        return f"{o[ci]['blocks_per_sm']}, {o[ci]['warps_per_sm']}" if o else "-"

    def ms(name):
        c = cands.get(name, {}) if name else {}
        return f"{c['time_s'] * 1e3:.3f}" if c.get("status") == "ok" else (c.get("status") or "-")

    def tflops(name):
        return f"{ok[name]['tflops']:.0f}" if name in ok else "-"

    mismatched = sum(v.get("status") == "mismatch" for v in cands.values())
    return [str(row["n"]), str(row["b"]), str(row["h"]), str(row["causal"]),
            best or "-", ms(best), tflops(best), regs(best), occ(best),
            largest or "-", ms(largest), tflops(largest), regs(largest), occ(largest),
            f"{table_name}: {ms(table_name)}", f"{row['torch_flash_s'] * 1e3:.3f}" + ("" if row.get("torch_backend", "FLASH_ATTENTION") == "FLASH_ATTENTION"
                                                else f" ({row['torch_backend']})"),
            f"{len(ok)} / {mismatched}"]


_HEADER = ["N", "B", "H", "causal", "fastest", "ms", "TFLOP/s", "regs", "blocks/SM, warps/SM",
           "largest legal", "ms", "TFLOP/s", "regs", "blocks/SM, warps/SM", "table tile: ms", "torch flash ms",
           "ok / mismatched"]


def write_outputs(result, out_dir, ops):
    """Three files whatever the ops: schedule_search.json (everything), schedule_search.md (a
    section per op, a table per head dim) and schedule_search.log (result["log"])."""
    (out_dir / "schedule_search.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "schedule_search.log").write_text("".join(f"{ln}\n" for ln in result.get("log", [])))
    md = [f"# Schedule search on {result['device']['name']}", "",
          "bfloat16, B*N = 16384 tokens, H*d = 2048. Times: median of CUDA-event repeats, L2 flushed before "
          "each; TFLOP/s in the peers' dense-equivalent convention (4*B*H*N^2*d, halved causal, x2.5 for the "
          "backward ops, which time the whole atomic-dQ backward). Registers and occupancy of the "
          "instantiation that ran (causal or not). Largest legal tile: the largest block that compiles "
          "without spilling.", ""]
    for op in ops:
        md += [f"# {op}: {OP_TITLE[op]}", ""]
        for bucket in result["buckets"].values():
            if bucket["op"] != op:
                continue
            md += [f"## {op}, d = {bucket['d']}", "",
                   f"Timed (compiled clean): {', '.join(bucket['chosen'])}. Largest legal tile: {bucket['largest']}.",
                   "", "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
            for row in bucket["shapes"]:
                if row.get("skipped"):
                    cells = [str(row["n"]), str(row["b"]), str(row["h"]), str(row["causal"]),
                             f"skipped ({row['skipped']})".replace("|", "/")] + [""] * (len(_HEADER) - 5)
                else:
                    cells = _row_cells(op, bucket, row)
                md.append("| " + " | ".join(cells) + " |")
            md.append("")
    (out_dir / "schedule_search.md").write_text("\n".join(md))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output directory (device run)")
    ap.add_argument("--dry-run", action="store_true", help="list the candidates per (op, d); no GPU needed")
    ap.add_argument("--ops", default=",".join(OPS),
                    help=f"comma-separated subset of {OPS} (the wgmma ops run on sm_90 only, for the head dims "
                         "of their Hopper tables)")
    ap.add_argument("--ds", default=",".join(map(str, DS)))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--per-bucket", type=int, default=None,
                    help=f"clean candidates timed per (op, d), plus the largest (default per op: {PER_BUCKET})")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new work after this many seconds")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="processes warming CuPy's compile cache first (0: compile serially, in this process)")
    args = ap.parse_args(argv)
    for op in args.ops.split(","):
        if op not in OPS:
            ap.error(f"--ops: expected a subset of {OPS}, got {op!r}")
    if args.dry_run:
        ds = tuple(int(x) for x in args.ds.split(","))
        ns = tuple(int(x) for x in args.ns.split(","))
        pl = plan(tuple(args.ops.split(",")), ds, args.per_bucket)
        print_plan(pl, device_limits.H200, planned_shapes(ds, ns))
        return 0
    if not args.out:
        ap.error("--out DIR is required for the device run")
    return device_main(args)


if __name__ == "__main__":
    sys.exit(main())
