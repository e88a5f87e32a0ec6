"""The benchmark grid as one table: cuflash against cuDNN per cell, over several passes.

    python3 tools/grid_table.py fwd_1.json bwd_1.json fwd_2.json ... (benchmarks/peers.py outputs)

Per cell (op, dtype, d, N, causal; decode also B and heads): cuDNN ms / cuflash ms in each pass (same process, same inputs),
their min and max, and whether the cell meets the target (1.05; decode 1.0; no bar for the
backward past d=128 or decode shapes outside the decode grid) in every pass (met), in none (short)
or in some (split). Decode grid cells also get
cuflash's and cuDNN's read rate as a share of the same run's read-only stream (ceilings.read_tbps).
"""
import json
import sys
from collections import defaultdict

BAR = 1.05
# The decode grid (benchmarks/peers.py --ops decode): d=128, Hq=32, (B, Hkv) in these; other decode shapes
# (MQA, other head dims: benchmarks/peers.py --decode-shapes) are listed without a verdict.
DECODE_GRID_HEADS = {(8, 8), (64, 8), (8, 32)}


def in_decode_grid(d, b, hq, hkv):
    return d == 128 and hq == 32 and (b, hkv) in DECODE_GRID_HEADS


def main(paths):
    ratios = defaultdict(list)  # cell -> [ratio per pass]
    fa2 = defaultdict(list)
    of_read = defaultdict(lambda: defaultdict(list))  # decode cell -> impl -> [tbps / read ceiling]
    for path in paths:
        try:
            doc = json.load(open(path))
        except (OSError, ValueError) as exc:
            print(f"{path}: unreadable ({exc})")
            continue
        cells = defaultdict(dict)
        read = doc.get("ceilings", {}).get("read_tbps")
        for r in doc.get("bench", []):
            if r.get("ms") is None or r.get("status") not in ("ok", None):
                continue
            cells[(r["op"], r["dtype"], r["d"], r["nk"], bool(r["causal"]), r["b"], r["hq"], r["hkv"])][r["impl"]] = r["ms"]
            if read and r["op"] == "decode" and r.get("tbps") and in_decode_grid(r["d"], r["b"], r["hq"], r["hkv"]):
                of_read[(r["nk"], r["b"], r["hkv"])][r["impl"]].append(r["tbps"] / read)
        for cell, ms in cells.items():
            if "cuflash" in ms and "torch-cudnn" in ms:
                ratios[cell].append(ms["torch-cudnn"] / ms["cuflash"])
            if "cuflash" in ms and "torch-flash" in ms:
                fa2[cell].append(ms["torch-flash"] / ms["cuflash"])
    print(f"{'op':6} {'dtype':9} {'d':>4} {'N':>6} {'mask':6} {'':11} x cuDNN per pass            min    max   bar  x FA2")
    short = []
    for cell in sorted(ratios):
        op, dtype, d, n, causal, b, hq, hkv = cell
        shape = f"B{b} H{hq}/{hkv}" if op == "decode" else ""
        rs = ratios[cell]
        lo, hi = min(rs), max(rs)
        bar = 1.0 if op == "decode" else BAR  # the decode target; backward's bar is at d <= 128
        verdict = "-" if _no_bar(cell) else "met" if lo >= bar else "short" if hi < bar else "split"
        if verdict in ("short", "split"):
            short.append((cell, lo, hi))
        per = " ".join(f"{r:.3f}" for r in rs)
        f = fa2.get(cell)
        vs_fa2 = f"{min(f):.2f}" if f else "-"
        print(f"{op:6} {dtype:9} {d:>4} {n:>6} {'causal' if causal else 'full':6} {shape:11} {per:26} {lo:.3f}  "
              f"{hi:.3f}  {verdict:5} {vs_fa2}")
    judged = sum(1 for c in ratios if not _no_bar(c))
    print(f"\n{judged} cells under the bar ({BAR}; decode 1.0); met in every pass by {judged - len(short)}; "
          f"short in some pass: {len(short)}")
    if of_read:
        print("\ndecode read rate / the run's read-only stream (min-max over passes)")
        for (n, b, hkv), impls in sorted(of_read.items()):
            shares = "  ".join(f"{impl} {min(v):.3f}-{max(v):.3f}" for impl, v in sorted(impls.items())
                               if impl in ("cuflash", "torch-cudnn"))
            print(f"  L={n:>6} B={b:<3} Hkv={hkv:<3} {shares}")
    return 0


def _no_bar(cell):
    """Cells outside the bars: the backward past d=128, decode shapes outside the decode grid."""
    op, dtype, d, n, causal, b, hq, hkv = cell
    return (op == "bwd" and d > 128) or (op == "decode" and not in_decode_grid(d, b, hq, hkv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
