"""Plot and tabulate a benchmark summary: cuflash against torch SDPA's cuDNN and FlashAttention-2
backends, forward and backward TFLOP/s per head dim and sequence length, and the decode rows.

    python tools/plot_results.py [SUMMARY.json] [--out docs/img/performance.png] [--dtype bfloat16]
    python tools/plot_results.py [SUMMARY.json] --tables      # Markdown tables for docs/performance.md

SUMMARY defaults to the newest benchmarks/results/*.json (a summary written by tools/summarize.py
from tools/gpu_check.sh). TFLOP/s are in the peers' dense-equivalent convention (4·B·H·N²·d,
halved when causal, 2.5x that for the backward), so all three libraries are counted alike. Needs
matplotlib for the plot (`pip install -e ".[plot]"`), nothing for --tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = (("cuflash", "cuflash", "C0"), ("torch-cudnn", "cuDNN (torch SDPA)", "C1"),
         ("torch-flash", "FlashAttention-2 (torch SDPA)", "C2"))


def newest_summary() -> Path:
    found = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    if not found:
        raise SystemExit("no summary JSON under benchmarks/results/; pass one")
    return found[-1]


def rows_of(summary: dict, op: str, dtype: str | None = None) -> list[dict]:
    return [r for r in summary.get("bench", []) if r.get("op") == op and r.get("status") == "ok"
            and (dtype is None or r.get("dtype") == dtype)]


def index(rows):
    """{(dtype, d, nq, causal, impl): row} for forward/backward rows."""
    return {(r["dtype"], r["d"], r["nq"], bool(r["causal"]), r["impl"]): r for r in rows}


def _n_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def plot(summary: dict, out: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in ("fwd", "bwd") if rows_of(summary, op, dtype)]
    ds = sorted({r["d"] for op in ops for r in rows_of(summary, op, dtype)})
    if not ops or not ds:
        raise SystemExit(f"no forward/backward rows in {dtype}")
    fig, axes = plt.subplots(len(ops), len(ds), figsize=(3.6 * len(ds), 3.0 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        table = index(rows_of(summary, op, dtype))
        top = 1.08 * max(r["tflops"] for k, r in table.items() if k[4] in {p[0] for p in PEERS})
        for j, d in enumerate(ds):
            ax = axes[i][j]
            ns = sorted({k[2] for k in table if k[1] == d})
            for impl, label, color in PEERS:
                for causal, style in ((False, "-"), (True, "--")):
                    pts = [(n, table[(dtype, d, n, causal, impl)]["tflops"]) for n in ns
                           if (dtype, d, n, causal, impl) in table]
                    if pts:
                        ax.plot(range(len(pts)), [t for _, t in pts], style, marker="o", ms=3.5, color=color,
                                label=f"{label}{', causal' if causal else ''}")
                        ax.set_xticks(range(len(pts)), [_n_label(n) for n, _ in pts])
            ax.set_title(f"{'forward' if op == 'fwd' else 'backward'}, d={d}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.set_ylim(0, top)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(ops) - 1:
                ax.set_xlabel("sequence length N")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"{summary.get('device', 'GPU')}, {dtype}, 16k tokens per batch, hidden 2048", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def tables(summary: dict) -> str:
    """Markdown: forward/backward TFLOP/s with the ratios cuflash / peer, then the decode rows."""
    lines = []
    for op, title in (("fwd", "Forward"), ("bwd", "Backward")):
        table = index(rows_of(summary, op))
        keys = sorted({k[:4] for k in table}, key=lambda k: (k[0], k[1], k[3], k[2]))
        if not keys:
            continue
        lines += [f"### {title}", "",
                  "| dtype | d | N | causal | cuflash TFLOP/s | cuDNN | FA2 | x cuDNN | x FA2 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k in keys:
            got = [table.get(k + (impl,)) for impl, _, _ in PEERS]
            if got[0] is None:
                continue
            t = [g["ms"] if g else None for g in got]
            f = [f"{g['tflops']:.0f}" if g else "-" for g in got]
            x = [f"{t[i] / t[0]:.2f}" if t[i] else "-" for i in (1, 2)]
            lines.append(f"| {k[0]} | {k[1]} | {_n_label(k[2])} | {'yes' if k[3] else 'no'} | "
                         f"{f[0]} | {f[1]} | {f[2]} | {x[0]} | {x[1]} |")
        lines.append("")
    dec = rows_of(summary, "decode")
    if dec:
        lines += ["### Decode (one query token per sequence)", "",
                  "| d | B | Hq | Hkv | cache L | cuflash us | TB/s | cuDNN us | FA2 us | x cuDNN | x FA2 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        by = {}
        for r in dec:
            by.setdefault((r["d"], r["b"], r["hq"], r["hkv"], r["nk"]), {})[r["impl"]] = r
        for (d, b, hq, hkv, nk), g in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][3] > 1, kv[0])):
            if "cuflash" not in g:
                continue
            c = g["cuflash"]["ms"]
            peer = [g.get(i) for i in ("torch-cudnn", "torch-flash")]
            us = [f"{p['ms'] * 1e3:.1f}" if p else "-" for p in peer]
            x = [f"{p['ms'] / c:.2f}" if p else "-" for p in peer]
            lines.append(f"| {d} | {b} | {hq} | {hkv} | {_n_label(nk)} | {c * 1e3:.1f} | "
                         f"{g['cuflash']['tbps']:.2f} | {us[0]} | {us[1]} | {x[0]} | {x[1]} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", nargs="?", type=Path, help="summary JSON (default: the newest in benchmarks/results/)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "performance.png")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tables", action="store_true", help="print Markdown tables instead of plotting")
    args = ap.parse_args(argv)
    path = args.summary or newest_summary()
    summary = json.loads(path.read_text())
    if args.tables:
        print(tables(summary))
    else:
        plot(summary, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
