"""Table of an A/B run's ratios (cuDNN ms / cuflash ms), one line per cell, each variant's runs in
run order. Files are <prefix>_<variant>_<run>.json: benchmarks/peers.py output ({"bench": rows},
keyed by op, dtype, d, nq, causal; decode by op, dtype, d, b, hkv, nk) or tools/hopper_fwd_sweep.py output (rows with vs_cudnn,
keyed by d, n, causal, tile).

    python3 tools/ab_summary.py AB "$OUT/fwd_*_*.json"
"""
import glob
import json
import sys
from collections import defaultdict


def ratios(path):
    """{cell: cuDNN ms / cuflash ms} of one run's file."""
    data = json.load(open(path))
    if isinstance(data, list):  # hopper_fwd_sweep.py
        return {(r["d"], r["n"], r["causal"], r["tile"]): r["vs_cudnn"] for r in data}
    ms = defaultdict(dict)
    for row in data.get("bench", []):
        cell = (row["op"], row["dtype"], row["d"], row["nq"], row["causal"])
        if row["op"] == "decode":  # one query token: the cells differ in batch, K/V heads and cache length
            cell = (row["op"], row["dtype"], row["d"], row["b"], row["hkv"], row["nk"])
        ms[cell][row["impl"]] = row["ms"]
    return {k: v["torch-cudnn"] / v["cuflash"] for k, v in ms.items() if "cuflash" in v and "torch-cudnn" in v}


def main():
    label, pattern = sys.argv[1], sys.argv[2]
    run = lambda f: int(f.rsplit("_", 1)[1].split(".")[0])  # noqa: E731
    table = defaultdict(lambda: defaultdict(list))
    for f in sorted(glob.glob(pattern), key=run):
        variant = f.rsplit("/", 1)[1].split("_")[1]
        for cell, x in ratios(f).items():
            table[cell][variant].append(x)
    for cell in sorted(table, key=str):
        runs = table[cell]
        print(label, *cell, " ".join(f"{v}: " + "/".join(f"{x:.3f}" for x in runs[v]) for v in sorted(runs)))


if __name__ == "__main__":
    main()
