"""``python -m cuflash report``: FLOPs, memory and HBM-traffic tables for one shape, tiled vs reference.

``--measure`` runs one forward launch under Nsight Compute and prints the measured DRAM bytes and
kernel time beside the model; ``--plot DIR`` draws memory and traffic against N (needs matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..api.functional import attention
from ..core import sequence_split
from ..core.arrays import BFLOAT16
from ..kernels.build import compile_offline
from .common import _positive
from .. import accounting
from ..plan import schedule
from ..accounting import format_table

NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
KERNEL_REGEX = "regex:attn_(fwd|decode)"  # the prefill kernel, or split-KV decode and its combine
_UNIT_SCALE = {
    "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0,
}
_BASE_UNIT = {"dram__bytes_read.sum": "byte", "dram__bytes_write.sum": "byte", "gpu__time_duration.sum": "nsecond"}


def _shape_arg(text):
    parts = text.split(",")
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: expected four integers B,H,N,d, got {text!r}") from None
    if len(vals) != 4 or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"--shape: expected four positive integers B,H,N,d, got {text!r}")
    return vals


def build_parser():
    ap = argparse.ArgumentParser(
        prog="cuflash report",
        description="Exact FLOPs, device memory by category and the HBM-traffic model of one attention "
                    "shape, for cuflash's tiled kernels and the materializing reference.")
    ap.add_argument("--shape", required=True, type=_shape_arg, metavar="B,H,N,d",
                    help="batch, query heads, sequence length (new query tokens with --decode), head dim")
    ap.add_argument("--hkv", type=_positive, metavar="H", help="K/V heads (GQA/MQA); default: H")
    ap.add_argument("--causal", nargs="?", const="bottom_right", default=None, choices=("bottom_right", "top_left"),
                    help="causal mask; bare --causal means bottom_right (query i sees keys j <= i + Nk - Nq)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--decode", type=_positive, metavar="L",
                    help="decoding: the N queries of --shape attend to a cache of L keys (N=1: one token)")
    ap.add_argument("--splits", type=_positive, default=None, metavar="S",
                    help="split-KV partitions of the forward (their float32 partials are workspace); default: "
                         "what the decode kernel picks on the H200 for few query tokens, else 1")
    ap.add_argument("--registers", action="store_true",
                    help="compile the forward kernel offline (NVRTC, no GPU) to report registers per thread")
    ap.add_argument("--plot", metavar="DIR", help="write memory-vs-N and traffic-vs-N plots (needs matplotlib)")
    ap.add_argument("--measure", action="store_true",
                    help="run one forward under Nsight Compute (needs a GPU, CuPy and ncu on PATH)")
    ap.add_argument("--context-parallel", type=_positive, metavar="P",
                    help="model cuflash.distributed.ring_attention over P ranks instead (N is the whole sequence): "
                         "per-rank FLOPs, bytes sent per step, compute vs transfer per step, predicted scaling")
    ap.add_argument("--cp-mode", default="auto", choices=("auto", "ring", "allgather"),
                    help="context-parallel mode (auto: all-gather when H >= P * Hkv, as ring_attention picks)")
    ap.add_argument("--link-gbps", type=float, default=accounting.CP_LINK_GBPS, metavar="GB/s",
                    help="link bandwidth per direction for --context-parallel (default: %(default)s, NVLink 4)")
    ap.add_argument("--tflops", type=float, default=None, metavar="T",
                    help="compute rate for --context-parallel (default: the 16-bit kernels' measured H200 rates, "
                         f"{accounting.CP_TFLOPS_FWD:g} forward / {accounting.CP_TFLOPS_BWD:g} backward)")
    ap.add_argument("--launch-only", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage and the error
        return int(e.code or 0)
    b, h, n, d = args.shape
    hkv = args.hkv or h
    if h % hkv:
        print(f"cuflash report: error: --hkv {hkv} must divide the {h} query heads", file=sys.stderr)
        return 2
    dims = dict(batch=b, hq=h, hkv=hkv, nq=n, nk=args.decode or n, d=d, dtype=args.dtype, causal=args.causal)
    if args.launch_only:
        return _launch_only(**dims)
    if args.context_parallel:
        if args.decode:
            print("cuflash report: error: --context-parallel models one sequence attending to itself; drop --decode",
                  file=sys.stderr)
            return 2
        try:
            print(context_parallel_text(dims, args.context_parallel, mode=args.cp_mode, link_gbps=args.link_gbps,
                                        tflops=args.tflops))
        except (ValueError, TypeError) as e:
            print(f"cuflash report: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.plot and not _have_matplotlib():
        print("cuflash report: --plot needs matplotlib, which is not installed "
              "(pip install matplotlib, or the cuflash[plot] extra)", file=sys.stderr)
        return 2
    ncu = None
    if args.measure:
        ncu, why = find_gpu_and_ncu()
        if ncu is None:
            print(f"cuflash report: --measure needs a CUDA GPU through CuPy and Nsight Compute: {why}", file=sys.stderr)
            return 2
    registers = _offline_registers(dims) if args.registers else None
    try:
        print(report_text(dims, splits=args.splits, registers=registers))
    except (ValueError, TypeError) as e:
        print(f"cuflash report: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        for path in write_plots(args.plot, dims, plot_series(dims)):
            print(f"wrote {path}")
    if ncu is not None:
        return _measure(ncu, dims)
    return 0


# --------------------------------------------------------------------------- the tables


def _cp_mode(mode, hq, hkv, world):
    return sequence_split.pick_mode(hq, hkv, world) if mode == "auto" else mode


def context_parallel_text(dims, world, *, mode="auto", link_gbps=accounting.CP_LINK_GBPS, tflops=None) -> str:
    """The context-parallel model (accounting.context_parallel) of one shape on ``world`` ranks."""
    b, hq, hkv, n, d = dims["batch"], dims["hq"], dims["hkv"], dims["nq"], dims["d"]
    causal = bool(dims["causal"])
    picked = _cp_mode(mode, hq, hkv, world)
    head = (f"cuflash report --context-parallel {world}: B={b} Hq={hq} Hkv={hkv} N={n} (whole sequence) d={d} "
            f"{dims['dtype']} causal={causal} mode={picked} balance=zigzag")
    parts = [head]
    for pass_ in ("fwd", "bwd"):
        m = accounting.context_parallel((b, hq, n, d), world, hkv=hkv, causal=causal, dtype=dims["dtype"], mode=picked,
                                        pass_=pass_, tflops=tflops, link_gbps=link_gbps)
        ranks = format_table(("rank", "FLOPs", "rows"), [(r, f"{f:,}", f"{_rows_of(n, world, r):,}")
                                                          for r, f in enumerate(m.rank_flops)])
        parts += ["", f"== {pass_}: per-rank FLOPs ==", ranks, "", f"== {pass_}: steps ==", m.table(), "",
                  f"{pass_}: modelled {m.time_s * 1e3:.3f} ms vs one device {m.single_device_s * 1e3:.3f} ms: "
                  f"speedup {m.speedup:.2f} on {world} (efficiency {m.efficiency:.3f})"] + [f"  {x}" for x in m.notes]
    rows = []
    for p in sorted({2, 4, 8, world}):
        row = [p, _cp_mode(mode, hq, hkv, p)]
        for pass_ in ("fwd", "bwd"):
            m = accounting.context_parallel((b, hq, n, d), p, hkv=hkv, causal=causal, dtype=dims["dtype"], mode=row[1],
                                            pass_=pass_, tflops=tflops, link_gbps=link_gbps)
            row += [f"{m.time_s * 1e3:.2f}", f"{m.speedup:.2f}"]
        rows.append(tuple(row))
    parts += ["", "== predicted scaling ==",
              format_table(("P", "mode", "fwd ms", "fwd speedup", "bwd ms", "bwd speedup"), rows),
              "", "The rates are the 16-bit wgmma kernels'. ring_attention keeps float32 partials: on the GPU its "
              "forward steps run the mma.sync kernel with a float32 epilogue and its backward steps the float32 "
              "kernels, below these rates (docs/distributed.md)."]
    return "\n".join(parts)


def _rows_of(n, world, r):
    return sum(b - a for _, a, b in sequence_split.chunk_bounds(n, world, "zigzag")[r])


def _shapes(dims):
    q = (dims["batch"], dims["hq"], dims["nq"], dims["d"])
    k = (dims["batch"], dims["hkv"], dims["nk"], dims["d"])
    return q, k


def _io(dims, pass_):
    return accounting.io_model((dims["batch"], dims["hq"], dims["nq"], dims["d"]), dtype=dims["dtype"],
                               causal=dims["causal"], pass_=pass_, nk=dims["nk"], hkv=dims["hkv"])


def flops_table(dims) -> str:
    q, k = _shapes(dims)
    io = _io(dims, "fwd+bwd")  # pairs inside the visible tiles of each pass (masked entries included)
    hd = schedule.head_dim_bucket(dims["d"])
    all_pairs = dims["batch"] * dims["hq"] * dims["nq"] * dims["nk"]
    executed = {"fwd": 4 * io.computed_pairs * hd, "bwd": 10 * io.bwd_computed_pairs * hd}
    executed["fwd+bwd"] = executed["fwd"] + executed["bwd"]
    rows, conventions = [], []
    for pass_, per_pair in (("fwd", 4), ("bwd", 10), ("fwd+bwd", 14)):
        f = accounting.flops(q, k, causal=dims["causal"], pass_=pass_)
        rows.append((pass_, f"{f.pairs:,}", f"{f.flops:,}", f"{f.dense_equivalent:,}",
                     f"{executed[pass_]:,}", f"{per_pair * all_pairs * dims['d']:,}"))
        conventions.append(f"{pass_}: {f.convention}; dense-equivalent: {f.dense_convention}")
    t = format_table(("pass", "exact pairs", "exact FLOPs", "dense-equivalent (peers)",
                      "tiled kernels execute", "reference executes"), rows)
    notes = [f"tiled kernels execute: every entry of the visible tiles ({io.computed_pairs:,} pairs in the "
             f"forward's {io.block_m}x{io.block_n} tiles, {io.bwd_computed_pairs:,} in the backward's "
             f"{io.bwd_block_m}x{io.bwd_block_n}; masked entries of diagonal and ragged tiles included), head "
             f"dim padded to {hd} on chip",
             "reference executes: all Nq*Nk pairs, the mask applied after the product"]
    return "\n".join([t] + [f"convention {c}" for c in conventions] + [f"note: {x}" for x in notes])


def report_text(dims, *, splits=None, registers=None) -> str:
    q, k = _shapes(dims)
    causal = dims["causal"]
    head = (f"cuflash report: B={dims['batch']} Hq={dims['hq']} Hkv={dims['hkv']} Nq={dims['nq']} "
            f"Nk={dims['nk']} d={dims['d']} {dims['dtype']} causal={causal or False}")
    parts = [head, "", "== FLOPs ==", flops_table(dims)]
    mem = {}
    for method in ("tiled", "reference"):
        for pass_ in ("fwd", "bwd"):
            r = accounting.memory_report(q, k, method=method, pass_=pass_, dtype=dims["dtype"], causal=causal,
                                         splits=splits if pass_ == "fwd" else 1,
                                         registers=registers if method == "tiled" else None)
            mem[method, pass_] = r
            parts += ["", f"== Memory: {method}, {pass_} ==", r.table()]
    rows = []
    for pass_ in ("fwd", "bwd"):
        t, r = mem["tiled", pass_], mem["reference", pass_]
        rows.append((pass_, f"{t.device_bytes:,}", f"{t.beyond_inputs_outputs:,}", f"{r.device_bytes:,}",
                     f"{r.beyond_inputs_outputs:,}", f"{r.beyond_inputs_outputs_in_place:,}"))
    parts += ["", "== Memory summary (bytes) ==",
              format_table(("pass", "tiled total", "tiled beyond in/out", "reference total",
                            "reference beyond in/out", "reference beyond, in place"), rows)]
    for pass_ in ("fwd", "bwd"):
        parts += ["", f"== HBM traffic model: tiled, {pass_} ==", _io(dims, pass_).table()]
    return "\n".join(parts)


# --------------------------------------------------------------------------- plots


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_series(dims, lengths=None) -> dict:
    """Memory and traffic of the forward against the sequence length (the cache length when decoding)."""
    decoding = dims["nk"] != dims["nq"]
    lengths = lengths or [2**e for e in range(8, 18)]
    out = {k: [] for k in ("n", "inputs_outputs", "tiled", "reference", "reference_in_place",
                           "io_tiled", "io_paper", "io_standard", "io_reference")}
    for n in lengths:
        dd = dict(dims, nk=n, nq=dims["nq"] if decoding else n)
        q, k = _shapes(dd)
        t = accounting.memory_report(q, k, method="tiled", dtype=dd["dtype"])
        r = accounting.memory_report(q, k, method="reference", dtype=dd["dtype"])
        io = _io(dd, "fwd")
        out["n"].append(n)
        out["inputs_outputs"].append(t.total(accounting.INPUT) + t.total(accounting.OUTPUT))
        out["tiled"].append(t.device_bytes)
        out["reference"].append(r.device_bytes)
        out["reference_in_place"].append(r.device_bytes_in_place)
        out["io_tiled"].append(io.elements)
        out["io_paper"].append(io.paper_elements)
        out["io_standard"].append(io.standard_elements)
        out["io_reference"].append(io.reference_elements)
    out["xlabel"] = "cache length L (keys)" if decoding else "sequence length N"
    return out


def write_plots(directory, dims, series):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    title = (f"B={dims['batch']} Hq={dims['hq']} Hkv={dims['hkv']} d={dims['d']} {dims['dtype']}"
             + (" causal" if dims["causal"] else "") + ", forward")

    def figure(lines, ylabel, what, name):
        """One log-log figure of series["n"] against the named series: (key, style, label[, kw])."""
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, style, label, *extra in lines:
            ax.loglog(series["n"], series[key], style, label=label, **(extra[0] if extra else {}))
        ax.set_xlabel(series["xlabel"])
        ax.set_ylabel(ylabel)
        ax.set_title(what + title, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.savefig(directory / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return directory / name

    paths = [
        figure([("tiled", "o-", "tiled: total device bytes"),
                ("inputs_outputs", "k:", "inputs + outputs alone", {"lw": 2, "zorder": 5}),
                ("reference", "s-", "reference (S and P): total"),
                ("reference_in_place", "s--", "reference, P in place of S: total")],
               "device bytes", "memory: ", "memory_vs_n.png"),
        figure([("io_tiled", "o-", "tile schedule (logical HBM elements)"),
                ("io_paper", "--", "paper: N^2 d^2 / M (unit constant)"),
                ("io_reference", "s-", "materializing reference (S, P written and read once)"),
                ("io_standard", "-.", "standard: (Nq+Nk) d + Nq Nk (unit constant)")],
               "HBM elements accessed", "HBM traffic model: ", "io_vs_n.png"),
    ]
    return paths


# --------------------------------------------------------------------------- registers (offline)


def _offline_registers(dims):
    """Registers per thread of the forward kernel for this shape, from ptxas via NVRTC; None if unknown."""
    try:
        dt = BFLOAT16 if dims["dtype"] == "bfloat16" else np.dtype(dims["dtype"])
        plan = accounting.model_forward_plan(dt, dims["d"], dims["causal"], dims["nq"], dims["nk"], dims["batch"],
                                             dims["hq"])
        return compile_offline(plan.spec).registers
    except Exception as e:  # a report without register counts is still a report
        print(f"cuflash report: registers unknown ({type(e).__name__}: {e})", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- measurement


def find_gpu_and_ncu():
    """(path of ncu, "") when a CUDA GPU is visible to CuPy and ncu is on PATH, else (None, why)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return None, "Nsight Compute's `ncu` is not on PATH"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return None, f"CuPy cannot reach a CUDA GPU ({type(e).__name__}: {e})"
    if count < 1:
        return None, "CuPy sees no CUDA GPU"
    return ncu, ""


def ncu_command(ncu, dims):
    argv = ["--launch-only", "--shape", f"{dims['batch']},{dims['hq']},{dims['nq']},{dims['d']}",
            "--hkv", str(dims["hkv"]), "--dtype", dims["dtype"]]
    if dims["nk"] != dims["nq"]:
        argv += ["--decode", str(dims["nk"])]
    if dims["causal"]:
        argv += ["--causal", dims["causal"]]
    launcher = "import sys, cuflash.cli.report as r; sys.exit(r.main(sys.argv[1:]))"
    return [ncu, "--clock-control", "none", "--metrics", ",".join(NCU_METRICS), "-k", KERNEL_REGEX,
            "--csv", "--page", "raw", "--print-units", "base", sys.executable, "-c", launcher, *argv]


def parse_ncu_csv(text):
    """Kernel rows of ``ncu --csv --page raw`` output: {"kernel", metric: value in bytes / seconds}."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.reader(lines[start:])
    header = next(reader)
    missing = [m for m in NCU_METRICS if m not in header]
    if missing:
        raise ValueError(f"ncu output lacks the metrics {missing}")
    units, rows = {}, []
    for rec in reader:
        if len(rec) != len(header):
            continue  # the profiled program's own output or ==PROF== lines
        rec = dict(zip(header, rec))
        if not rec["ID"].strip().isdigit():
            units = rec  # the units row under the header
            continue
        row = {"kernel": rec.get("Kernel Name", "")}
        for m in NCU_METRICS:
            unit = (units.get(m) or _BASE_UNIT[m]).strip()
            if unit not in _UNIT_SCALE:
                raise ValueError(f"ncu metric {m}: unknown unit {unit!r}")
            row[m] = float(rec[m].replace(",", "")) * _UNIT_SCALE[unit]
        rows.append(row)
    return rows


def _measure(ncu, dims) -> int:
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = ncu_command(ncu, dims)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"cuflash report: ncu failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}",
              file=sys.stderr)
        return 1
    try:
        rows = parse_ncu_csv(proc.stdout)
    except ValueError as e:
        print(f"cuflash report: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"cuflash report: ncu profiled no kernel matching {KERNEL_REGEX}:\n{proc.stdout[-4000:]}", file=sys.stderr)
        return 1
    read = sum(r["dram__bytes_read.sum"] for r in rows)
    write = sum(r["dram__bytes_write.sum"] for r in rows)
    seconds = sum(r["gpu__time_duration.sum"] for r in rows)
    io = _io(dims, "fwd")
    q, k = _shapes(dims)
    f = accounting.flops(q, k, causal=dims["causal"])

    def ratio(meas, model):
        return f"{meas / model:.3f}" if model else "-"

    table = format_table(("quantity", "model (logical)", "measured (ncu)", "measured / model"), [
        ("DRAM bytes read", f"{io.read_bytes:,}", f"{read:,.0f}", ratio(read, io.read_bytes)),
        ("DRAM bytes written", f"{io.write_bytes:,}", f"{write:,.0f}", ratio(write, io.write_bytes)),
        ("compulsory bytes", f"{io.compulsory_bytes:,}", f"{read + write:,.0f}", ratio(read + write, io.compulsory_bytes)),
        ("kernel time (ms)", "-", f"{seconds * 1e3:.4f}", "-"),
        ("exact TFLOP/s", "-", f"{f.tflops_per_s(seconds):.1f}", "-"),
        ("dense-equivalent TFLOP/s", "-", f"{f.dense_tflops_per_s(seconds):.1f}", "-"),
        ("DRAM TB/s (read + write)", "-", f"{(read + write) / seconds / 1e12:.3f}", "-"),
    ])
    print(f"\n== Measured: forward, {len(rows)} kernel launch(es) of {rows[0]['kernel']} ==")
    print(table)
    print("note: measured DRAM traffic is not the logical count: L2 hits remove rereads, and writes still "
          "in L2 when the kernel ends are not counted. Clocks were not locked (--clock-control none).")
    return 0


def _launch_only(*, batch, hq, hkv, nq, nk, d, dtype, causal) -> int:
    """One forward on fresh random CuPy data: the launch --measure profiles."""
    import cupy

    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng()

    def rand(shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dt))

    q, k, v = rand((batch, hq, nq, d)), rand((batch, hkv, nk, d)), rand((batch, hkv, nk, d))
    attention(q, k, v, causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
