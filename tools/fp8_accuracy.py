"""The FP8 accuracy table of docs/fp8.md: the error of FP8 attention's arithmetic
(cuflash.fp8.emulate_attention) against the float64 reference, per scale granularity, with and
without the Hadamard rotation of q and k, on normal inputs and on inputs with outliers.

    python3 tools/fp8_accuracy.py [--n 1024] [--heads 8] [--d 128] [--seeds 3]

Inputs: q, k, v drawn N(0, 1) in float32 and rounded to bfloat16 (the 16-bit tensors a user
would quantize); "outliers" replaces 0.1% of the entries by N(0, 10^2) draws. The reference is
the float64 attention of those bfloat16 values; each row of the table is the RMSE and the largest
error of o over every element, the mean over the seeds, and the ratio to the bfloat16 kernel's
RMSE (bfloat16 inputs, float32 softmax, P rounded to bfloat16) on the same inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import fp8  # noqa: E402
from cuflash.testing import reference64  # noqa: E402
from cuflash.core.arrays import BFLOAT16  # noqa: E402


def inputs(rng, shape, outliers):
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        hit = rng.random(shape) < 1e-3
        x = np.where(hit, 10.0 * rng.standard_normal(shape), x).astype(np.float32)
    return x.astype(BFLOAT16)


def run(q, k, v, granularity, rotate, p_dtype, seed):
    if rotate:
        r = fp8.hadamard_rotation(q.shape[-1], seed=seed)
        q, k = ((a.astype(np.float32) @ r).astype(np.float32) for a in (q, k))
    (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize(a, granularity=granularity) for a in (q, k, v))
    return fp8.emulate_attention(q8, k8, v8, dq, dk, dv, p_dtype=p_dtype)[0]


CONFIGS = [  # (label, granularity, rotate, P dtype)
    ("e4m3, per tensor", "tensor", False, fp8.E4M3),
    ("e4m3, per (batch, head)", "head", False, fp8.E4M3),
    ("e4m3, per tensor, Hadamard q, k", "tensor", True, fp8.E4M3),
    ("e4m3, per (batch, head), Hadamard q, k", "head", True, fp8.E4M3),
    ("e4m3 q, k, v; P in bfloat16, per (batch, head)", "head", False, np.dtype(BFLOAT16)),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    shape = (1, args.heads, args.n, args.d)
    print(f"o error against the float64 reference, B=1 H={args.heads} N={args.n} d={args.d}, mean of "
          f"{args.seeds} seeds (RMSE, largest, RMSE / bfloat16 kernel's)\n")
    print("| inputs | arithmetic | RMSE | max error | x bf16 RMSE |\n|---|---|---|---|---|")
    for outliers in (False, True):
        rows = {"bfloat16 kernel": [], **{label: [] for label, *_ in CONFIGS}}  # label -> [(RMSE, max)] per seed
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            q, k, v = (inputs(rng, shape, outliers) for _ in range(3))
            ref = reference64(q, k, v)[0]
            ones = np.float32(1.0)
            outs = {"bfloat16 kernel": fp8.emulate_attention(q, k, v, ones, ones, ones, p_dtype=np.dtype(BFLOAT16))[0]}
            outs.update({label: run(q, k, v, gran, rot, pdt, seed) for label, gran, rot, pdt in CONFIGS})
            for label, o in outs.items():
                err = o.astype(np.float64) - ref
                rows[label].append((np.sqrt(np.mean(err**2)), np.abs(err).max()))
        base_rmse = np.mean([r[0] for r in rows["bfloat16 kernel"]])
        for label, vals in rows.items():
            rmse, worst = np.mean([r[0] for r in vals]), np.mean([r[1] for r in vals])
            kind = "N(0,1), 0.1% outliers N(0,10^2)" if outliers else "N(0,1)"
            print(f"| {kind} | {label} | {rmse:.2e} | {worst:.2e} | {rmse / base_rmse:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
