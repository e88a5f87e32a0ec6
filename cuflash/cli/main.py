"""Command line: ``python -m cuflash`` / ``cuflash``.

    cuflash demo [--b B --h H --hkv HKV --n N --nk NK --d D --dtype T --causal [MODE] --backend B]
    cuflash report ...        (cuflash.cli.report)
    cuflash tune / schedules  (cuflash.cli.tune)

``demo`` runs attention on fresh random inputs with the best backend available, checks whole
heads against the float64 reference with the accuracy rule of :mod:`cuflash.testing`, and prints
the time, the exact FLOP count and the bytes it used. Subcommands that live in their own module
are listed in ``DELEGATED`` and take the rest of the command line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .. import testing
from ..api.functional import attention
from ..core import masks
from ..core.problem import check_head_dim
from . import report, tune
from .common import _positive, gpu_unavailable_reason

# name -> (function, help). Each function takes the remaining argv and returns an exit code.
DELEGATED = {
    "report": (report.main, "accounting report: FLOPs, memory and traffic of one shape; see `cuflash report --help`"),
    "tune": (tune.main_tune, "autotune tile schedules ahead of time (GPU); see `cuflash tune --help`"),
    "schedules": (tune.main_schedules, "legal tiles, registers, occupancy, traffic, tuned times"),
}

DTYPES = ("float16", "bfloat16", "float32")
# (B, H, N, d) when not given: small enough for NumPy, large enough to fill an H200.
CPU_DEFAULTS = (1, 4, 512, 64)
GPU_DEFAULTS = (4, 16, 4096, 128)


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _timed_median(run, backend, warmup, repeats):
    """Median seconds of `run()` after warm-up: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        run()
    times = []
    if backend == "gpu":
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(repeats):
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check_heads(q, k, v, o, lse, heads, group, causal, dtype):
    """Compare whole heads (b, h) of o and lse with the float64 reference; (ok, lines)."""
    lines, ok = [], True
    for b, h in heads:
        g = h // group
        qs, ks, vs = (testing.to_numpy(a[b : b + 1, i : i + 1]) for a, i in ((q, h), (k, g), (v, g)))
        got_o, got_lse = testing.to_numpy(o[b : b + 1, h : h + 1]), testing.to_numpy(lse[b : b + 1, h : h + 1])
        ref_o, ref_lse = testing.reference64(qs, ks, vs, causal=causal)
        yard_o = testing.faithful_realizations(qs, ks, vs, causal=causal)
        lse_bound = testing.lse_bound(qs, ks, vs, causal=causal)
        for name in ("o", "lse"):
            try:
                if name == "o":
                    err, bound = testing.assert_within_rule(f"o[{b},{h}]", got_o, ref_o, yard_o, dtype)
                    passed = err <= bound  # checked here too: asserts vanish under python -O
                    msg = f"max|err| {err:.3e} <= bound {bound:.3e}" if passed else f"max|err| {err:.3e} > bound {bound:.3e}"
                else:
                    err, ratio = testing.assert_lse_within_bound(f"lse[{b},{h}]", got_lse, ref_lse, lse_bound)
                    passed = ratio <= 1.0
                    msg = f"max|err| {err:.3e}, at most {ratio:.2g} of each row's float32 bound"
            except AssertionError as exc:
                passed, msg = False, str(exc)
            ok &= passed
            lines.append(f"{name}[b={b},h={h}]: {'ok' if passed else 'FAILED'}  {msg}")
    return ok, lines


def demo(args) -> int:
    reason = gpu_unavailable_reason()
    backend = args.backend
    if backend == "auto":
        backend = "gpu" if reason is None else "cpu"
    elif backend == "gpu" and reason is not None:
        print(f"cuflash demo: --backend gpu asked for, but {reason}", file=sys.stderr)
        return 2

    defaults = GPU_DEFAULTS if backend == "gpu" else CPU_DEFAULTS
    b = args.b or defaults[0]
    h = args.h or defaults[1]
    n = args.n or defaults[2]
    d = args.d or defaults[3]
    hkv = args.hkv or h
    nk = args.nk or n
    if h % hkv:
        print(f"cuflash demo: --hkv {hkv} must divide --h {h}", file=sys.stderr)
        return 2
    try:
        check_head_dim(d)
    except ValueError as exc:
        print(f"cuflash demo: --d: {exc}", file=sys.stderr)
        return 2
    dtype = _dtype(args.dtype)
    causal = args.causal  # None, "bottom_right" or "top_left"

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for shape in
            ((b, h, n, d), (b, hkv, nk, d), (b, hkv, nk, d))]
    if backend == "gpu":
        import cupy

        q, k, v = (cupy.asarray(a) for a in host)
        xp_name = f"CuPy on {cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)['name'].decode()}"
    else:
        q, k, v = host
        xp_name = "NumPy (tiled CPU backend)"

    o, lse = attention(q, k, v, causal=causal, return_lse=True)
    heads = sorted({(0, 0), (b - 1, h - 1)})
    ok, check_lines = _check_heads(q, k, v, o, lse, heads, h // hkv, causal, dtype)

    seconds = _timed_median(lambda: attention(q, k, v, causal=causal, return_lse=True), backend,
                            args.warmup, args.repeats)
    pairs = masks.pair_count(causal, n, nk)
    flops = 4 * pairs * d * b * h  # two products (QK^T and PV), 2 FLOPs per multiply-add
    in_bytes = sum(int(a.nbytes) for a in (q, k, v))
    out_bytes = int(o.nbytes)
    lse_bytes = int(lse.nbytes)
    scores_bytes = b * h * n * nk * 4  # what one materialized fp32 score matrix would take

    result = {
        "backend": backend, "device": xp_name, "seed": seed,
        "shape": {"B": b, "Hq": h, "Hkv": hkv, "Nq": n, "Nk": nk, "d": d},
        "dtype": args.dtype, "causal": causal,
        "seconds": seconds, "timer": "cuda events" if backend == "gpu" else "perf_counter",
        "warmup": args.warmup, "repeats": args.repeats,
        "pairs_per_head": pairs, "flops": flops, "tflops_per_s": flops / seconds / 1e12,
        "bytes": {"inputs": in_bytes, "outputs": out_bytes, "lse": lse_bytes,
                  "total": in_bytes + out_bytes + lse_bytes},
        "check": {"passed": ok, "heads": [list(x) for x in heads]},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"cuflash demo (seed {seed})")
        print(f"  backend  {backend}: {xp_name}")
        print(f"  shape    q ({b}, {h}, {n}, {d}), k/v ({b}, {hkv}, {nk}, {d}), {args.dtype}, causal={causal or False}")
        print("  check    whole heads vs the float64 reference (o: 2x the float32 yardstick's error + 1 rounding; "
              "lse: the float32 bound)")
        for line in check_lines:
            print(f"           {line}")
        print(f"  time     {seconds * 1e3:.3f} ms (median of {args.repeats} after {args.warmup} warm-up, "
              f"{result['timer']})")
        print(f"  FLOPs    {flops} = 4 x {pairs} pairs/head x d {d} x {b * h} heads")
        print(f"  TFLOP/s  {result['tflops_per_s']:.4g}")
        print(f"  memory   inputs {in_bytes} B + outputs {out_bytes} B + lse {lse_bytes} B = "
              f"{in_bytes + out_bytes + lse_bytes} B")
        print(f"           (a materialized float32 score matrix would add {scores_bytes} B; none is allocated)")
        print(f"  result   {'PASSED' if ok else 'FAILED: output outside the accuracy bound'}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cuflash", description="Exact dense attention for CuPy and NumPy.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    dp = sub.add_parser("demo", help="run attention on random inputs, check it, time it")
    dp.add_argument("--b", type=_positive, help="batch (default 1 on CPU, 4 on GPU)")
    dp.add_argument("--h", type=_positive, help="query heads (default 4 on CPU, 16 on GPU)")
    dp.add_argument("--hkv", type=_positive, help="key/value heads, dividing --h (default: --h)")
    dp.add_argument("--n", type=_positive, help="query length (default 512 on CPU, 4096 on GPU)")
    dp.add_argument("--nk", type=_positive, help="key length (default: --n)")
    dp.add_argument("--d", type=_positive, help="head dim (default 64 on CPU, 128 on GPU)")
    dp.add_argument("--dtype", choices=DTYPES, default="float16")
    dp.add_argument("--causal", nargs="?", const="bottom_right", default=None,
                    choices=("bottom_right", "top_left"),
                    help="causal mask; bare --causal means bottom_right")
    dp.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    dp.add_argument("--seed", type=int, help="input seed (default: fresh, printed)")
    dp.add_argument("--warmup", type=int, default=2)
    dp.add_argument("--repeats", type=_positive, default=5)
    dp.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    dp.set_defaults(run=demo)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return ap


def run_delegated(name, rest) -> int:
    run, _ = DELEGATED[name]
    return int(run(rest) or 0)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:  # everything after the name belongs to that command
        return run_delegated(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
