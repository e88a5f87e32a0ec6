"""``cuflash tune`` (autotune shapes ahead of time on the GPU) and ``cuflash schedules`` (the legal
tiles of a shape: registers, occupancy, traffic and tuned times)."""

from __future__ import annotations

import argparse
import sys

from ..autotune import (_text_progress, format_schedule_table, ops_that_run, schedule_rows, tune)
from ..core import config
from ..core.problem import MAX_HEAD_DIM
from ..plan import device_limits, schedule
from ..plan.tuning import OP_TITLE, Candidate, _check_op, cache_path, op_buckets, table_tile
from .common import gpu_unavailable_reason


def _parse_shape(text):
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected B,H,N,d integers, got {text!r}") from None
    if len(parts) != 4 or min(parts) < 1:
        raise ValueError(f"--shape: expected four positive integers B,H,N,d, got {text!r}")
    if parts[3] > MAX_HEAD_DIM:
        raise ValueError(f"--shape: head dim {parts[3]} is larger than the largest supported, {MAX_HEAD_DIM}")
    return parts


def _common_args(ap):
    ap.add_argument("--shape", action="append", required=True, metavar="B,H,N,d",
                    help="problem shape (repeatable for tune)")
    ap.add_argument("--causal", nargs="?", const="bottom_right", default=None, choices=("bottom_right", "top_left"),
                    help="causal mask (bare --causal: bottom_right)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--hkv", type=int, default=None, help="K/V heads (GQA), default H")


def main_tune(argv) -> int:

    ap = argparse.ArgumentParser(prog="cuflash tune", description="Autotune tile schedules ahead of time "
                                 "(needs a GPU); winners go to the cache used when CUFLASH_TUNE=1 or 'cached'.")
    _common_args(ap)
    ap.add_argument("--ops", default="auto",
                    help="comma-separated: fwd, fwd_wgmma, bwd, bwd_dq, bwd_wgmma; default auto: the tuned kernels "
                         "that run here (on sm_90: fwd_wgmma, with bwd_wgmma for d <= 128 and bwd above; elsewhere fwd "
                         "and bwd)")
    ap.add_argument("--max-candidates", type=int, default=None, help="candidates timed per bucket (default all legal)")
    ap.add_argument("--force", action="store_true", help="retune buckets already in the cache")
    args = ap.parse_args(argv)
    try:
        shapes = [_parse_shape(s) for s in args.shape]
        ops = "auto" if args.ops.strip() == "auto" else tuple(o.strip() for o in args.ops.split(",") if o.strip())
        for op in () if ops == "auto" else ops:
            _check_op(op)
    except ValueError as exc:
        ap.error(str(exc))

    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"cuflash tune: needs a GPU, but {reason}. `cuflash schedules` shows the legal tiles without one.",
              file=sys.stderr)
        return 2
    try:
        results = tune(*shapes, ops=ops, causal=args.causal or False, dtype=args.dtype, hkv=args.hkv,
                       max_candidates=args.max_candidates, force=args.force)
    except ValueError as exc:  # e.g. a wgmma op asked for off Hopper: said before anything is timed
        print(f"cuflash tune: {exc}", file=sys.stderr)
        return 2
    print(f"cache: {cache_path()}")
    for key, res in results.items():
        if res is None:
            print(f"{key}: cached (use --force to retune)")
            continue
        tbl = res.table
        w = res.winner
        if w is None:
            print(f"{key}: no candidate passed; the built-in table stays")
        else:
            vs = f" (table {tbl.candidate.name}: {tbl.time_s * 1e3:.4g} ms)" if tbl is not None and tbl.time_s else ""
            print(f"{key}: {w.candidate.name} {w.time_s * 1e3:.4g} ms{vs}")
        bad = [e for e in res.evaluations if e.status not in ("ok",)]
        for e in bad:
            print(f"    {e.candidate.name}: {e.status} {e.detail[:120]}")
    return 0


def main_schedules(argv) -> int:

    ap = argparse.ArgumentParser(prog="cuflash schedules", description="The candidate tiles of one bucket: "
                                 "registers, shared memory, occupancy, logical HBM bytes, cached times, the choice.")
    _common_args(ap)
    ap.add_argument("--bwd", action="store_true", help="the backward's K/V kernel instead of the forward (both "
                    "kernels, the wgmma one where the device is sm_90 and the head dim has a Hopper tile)")
    ap.add_argument("--dq", action="store_true", help="the deterministic backward's dQ kernel")
    ap.add_argument("--wgmma", action="store_true", help="only the Hopper wgmma kernel: the forward, or with --bwd "
                    "the backward K/V kernel (default: both kernels, the wgmma one where the device is sm_90 and "
                    "the head dim has a Hopper tile)")
    ap.add_argument("--device", choices=("auto", "h200", "current"), default="auto",
                    help="limits: the current GPU's, or the recorded H200's (auto: the GPU if there is one)")
    ap.add_argument("--no-compile", action="store_true", help="skip the NVRTC compiles (no register counts)")
    ap.add_argument("--all", action="store_true", help="also list the illegal candidates and why")
    args = ap.parse_args(argv)
    try:
        shapes = [_parse_shape(s) for s in args.shape]
    except ValueError as exc:
        ap.error(str(exc))
    if args.dq + args.bwd > 1 or args.dq + args.wgmma > 1:
        ap.error("--dq is one kernel: give it without --bwd or --wgmma (--bwd --wgmma: the Hopper backward only)")

    if args.device == "h200" or (args.device == "auto" and gpu_unavailable_reason() is not None):
        limits = device_limits.H200
        where = "recorded H200 limits (cuflash.plan.device_limits.H200)"
    else:
        if gpu_unavailable_reason() is not None:
            print(f"cuflash schedules: --device current, but {gpu_unavailable_reason()}", file=sys.stderr)
            return 2
        limits = device_limits.from_cupy()
        where = "this GPU"
    compile_ok = not args.no_compile
    if compile_ok:
        try:
            from cuda.bindings import nvrtc  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            print(f"note: cuda.bindings NVRTC unavailable ({type(exc).__name__}); registers not shown", file=sys.stderr)
            compile_ok = False
    jobs = []
    for shape in shapes:
        hd = schedule.head_dim_bucket(shape[3])
        family = "bwd" if args.bwd else "fwd"
        hopper_op = f"{family}_wgmma"
        wgmma = limits.cc == 90 and hd in op_buckets(hopper_op)
        if args.wgmma and not wgmma:
            what = "backward K/V kernel" if args.bwd else "forward"
            print(f"cuflash schedules: the wgmma {what} runs on sm_90 for head-dim buckets {op_buckets(hopper_op)}; "
                  f"not for d={shape[3]} on {limits.name} (cc {limits.cc})", file=sys.stderr)
            return 2
        ops = (["bwd_dq"] if args.dq else [hopper_op] if args.wgmma
               else [family] + ([hopper_op] if wgmma else []))
        jobs += [(shape, op) for op in ops]
    for shape, op in jobs:
        b, h, n, d = shape
        hd = schedule.head_dim_bucket(d)
        prog = _text_progress(f"compiling {op} d{hd}") if compile_ok and sys.stderr.isatty() else None
        evals, entry = schedule_rows(shape, op=op, causal=args.causal or False, dtype=args.dtype, limits=limits,
                                     compile=compile_ok, hkv=args.hkv, progress=prog)
        table = table_tile(op, hd)
        n_illegal = sum(e.status == "illegal" for e in evals)
        print(f"{OP_TITLE[op]}: B={b} H={h} N={n} d={d} (bucket {hd}) {args.dtype} causal={args.causal or False} on "
              f"{limits.name}, {where}")
        running = ops_that_run(hd, limits.cc)
        if op == "fwd" and "fwd_wgmma" in running:
            print("note: on this device the forward runs the wgmma kernel for this bucket (table below); "
                  "this one runs with CUFLASH_KERNELS=mma_sync or for unaligned inputs")
        if op == "bwd" and "bwd_wgmma" in running:
            print("note: on this device the backward's K/V kernel for this bucket is the wgmma one (bwd_wgmma, "
                  "table below); this one runs with CUFLASH_KERNELS=mma_sync or for unaligned inputs")
        print(f"limits: {limits.smem_per_block_optin:,} B shared memory per block (opt-in), {limits.smem_per_sm:,} per SM, "
              f"{limits.regs_per_sm} registers/SM (allocated per warp in {limits.reg_alloc_unit}s), "
              f"{limits.max_threads_per_sm} threads/SM")
        print(format_schedule_table(evals, entry, op=op, limits=limits, show_illegal=args.all, table=table))
        if not args.all:
            print(f"({n_illegal} of {len(evals)} candidates break a kernel static_assert or a device limit; --all lists them)")
        if entry is None:
            flags = f" --ops {op}" + (f" --causal {args.causal}" if args.causal else "")
            print(f"time: not tuned for {limits.name} (run `cuflash tune --shape {b},{h},{n},{d}{flags}` on the GPU; "
                  f"{config.TUNE}=1 or 'cached' uses the winner)")
        elif entry["winner"] is None:
            print("tuned: no candidate passed; the built-in table is used")
        print(f"table: {Candidate(op, hd, table).name}: {table.reason}")
        print()
    if compile_ok:
        print(f"(register reports are cached in {cache_path()}; {config.CACHE_DIR} moves it)", file=sys.stderr)
    return 0
