"""Draw the asv history: TFLOP/s (decode: TB/s) over the recorded commits for cuflash, the
materializing reference and torch SDPA on cuDNN, from the committed asv results.

    python benchmarks/history.py [--machine h100] [--results benchmarks/results/asv] [--out docs/img]

Writes history-forward.png, history-backward.png and history-decode.png: one figure per
operation, a panel per head dim and mask, commits oldest to newest along x. Rates follow the
peers' convention (4·B·H·N²·d, halved when causal, 2.5x for the backward; decode: the K/V cache
bytes read per call) over asv's median wall time of one call (launch and synchronize included,
so the small cells read lower than the CUDA-event rates of benchmarks/peers.py). Needs
matplotlib (`pip install -e ".[plot]"`); `--table` prints the forward and backward rates as
Markdown instead.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "benchmarks"))
from bench_attention import MODEL_WIDTH, TOKENS, _DecodeInputs  # noqa: E402

IMPLS = (("Cuflash", "cuflash", "-", "o"), ("Cudnn", "cuDNN (torch SDPA)", "--", "s"),
         ("Reference", "reference (materializing)", ":", "^"))
OPS = {"forward": ("Forward", "time_forward", 1.0), "backward": ("Backward", "time_backward", 2.5)}


def load_history(results: Path, machine: str) -> list[dict]:
    """The machine's result files, oldest commit first (asv records the commit's date)."""
    runs = []
    for path in (results / machine).glob("*.json"):
        if path.name in ("machine.json", "benchmarks.json"):
            continue
        data = json.loads(path.read_text())
        if data.get("version") == 2:
            runs.append(data)
    if not runs:
        raise SystemExit(f"no asv results for machine {machine!r} under {results}")
    return sorted(runs, key=lambda d: d["date"])


def cells(data: dict, name: str) -> dict:
    """{params tuple (as asv writes them): median seconds} of one benchmark in one run."""
    row = data["results"].get(name)
    if row is None:
        return {}
    cols = dict(zip(data["result_columns"], row))
    values = cols.get("result") or []
    return {combo: v for combo, v in zip(itertools.product(*cols["params"]), values)
            if isinstance(v, (int, float)) and math.isfinite(v)}


def prefill_tflops(n: int, causal: bool, factor: float, seconds: float) -> float:
    flops = 4.0 * n * TOKENS * MODEL_WIDTH * (0.5 if causal else 1.0) * factor  # B*N = TOKENS, H*d = MODEL_WIDTH
    return flops / seconds / 1e12


def decode_tbps(cache_len: int, shape: str, seconds: float) -> float:
    b, _, hkv = (int(x) for x in shape.split("x"))
    return 2 * b * hkv * cache_len * _DecodeInputs.d * 2 / seconds / 1e12  # K and V, 2 bytes each


def series(runs, op):
    """{(impl, d, causal, n): [rate or None per run]} for a prefill operation."""
    cls, method, factor = OPS[op]
    out = {}
    for i, data in enumerate(runs):
        for impl, *_ in IMPLS:
            for (n, d, causal, _dtype), sec in cells(data, f"bench_attention.{impl}{cls}.{method}").items():
                key = (impl, int(d), causal == "True", int(n))
                out.setdefault(key, [None] * len(runs))[i] = prefill_tflops(int(n), causal == "True", factor, sec)
    return out


def labels(runs):
    return [f"{d['commit_hash'][:7]}" for d in runs]


def draw_prefill(plt, runs, op, out: Path):
    data = series(runs, op)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    x = range(len(runs))
    ns = sorted({k[3] for k in data})
    shades = {n: f"C{i}" for i, n in enumerate(ns)}
    for ax, (d, causal) in zip(axes.flat, itertools.product((64, 128), (False, True))):
        for impl, name, style, marker in IMPLS:
            for n in ns:
                ys = data.get((impl, d, causal, n))
                if ys and any(y is not None for y in ys):
                    ax.plot(x, [math.nan if y is None else y for y in ys], style, marker=marker, ms=4,
                            color=shades[n], label=f"{name}, N={n}")
        ax.set_title(f"{op}, d={d}, {'causal' if causal else 'full'} (bf16, B*N={TOKENS}, H*d={MODEL_WIDTH})",
                     fontsize=9)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xticks(list(x), labels(runs), rotation=60, fontsize=7)
    handles = {}
    for ax in axes.flat:  # one legend for the figure: every panel draws the same kinds of lines
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"cuflash {op} over its history ({runs[-1]['params'].get('machine', '')}): asv median wall time per call")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_decode(plt, runs, out: Path):
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(runs))
    for (impl, name, style, marker), color in zip(IMPLS[:2], ("C0", "C1")):
        found = {}
        for i, data in enumerate(runs):
            for (cache_len, shape), sec in cells(data, f"bench_attention.{impl}Decode.time_decode").items():
                key = (int(cache_len), shape.strip("'"))
                found.setdefault(key, [math.nan] * len(runs))[i] = decode_tbps(*key, sec)
        for j, (key, ys) in enumerate(sorted(found.items())):
            if sum(math.isfinite(y) for y in ys) >= 2:
                ax.plot(x, ys, style, marker=marker, ms=4, color=f"C{2 * j + (color == 'C1')}",
                        label=f"{name}, {key[1]} x {key[0]}")
    ax.set_ylabel("TB/s (K/V bytes per call)")
    ax.set_xticks(list(x), labels(runs), rotation=60, fontsize=7)
    ax.set_title("decode (one query token, bf16, d=128, B x Hq x Hkv x cache length)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def table(runs) -> str:
    lines = []
    for op in OPS:
        data = series(runs, op)
        keys = sorted(k for k in data if k[0] == "Cuflash")
        lines += [f"\n{op}, cuflash TFLOP/s (asv median wall time):\n",
                  "| commit | " + " | ".join(f"d={d} {'c' if c else 'f'} N={n}" for _, d, c, n in keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        for i, lab in enumerate(labels(runs)):
            row = [data[k][i] for k in keys]
            lines.append(f"| {lab} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results" / "asv")
    ap.add_argument("--machine", default="h100")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img")
    ap.add_argument("--table", action="store_true", help="print Markdown tables instead of drawing")
    args = ap.parse_args(argv)
    runs = load_history(args.results, args.machine)
    if args.table:
        print(table(runs))
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for op in OPS:
        draw_prefill(plt, runs, op, args.out / f"history-{op}.png")
    draw_decode(plt, runs, args.out / "history-decode.png")
    print(f"{len(runs)} commits -> {args.out}/history-{{forward,backward,decode}}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
