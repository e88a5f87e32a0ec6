"""Quick wgmma-vs-mma.sync diagnosis on the GPU: max |error| against float64 for small shapes.

    python3 tools/hopper_diag.py        (prints one line per case; exit 1 on any failure)
"""
import os
import sys

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash.testing import naive_attention_in_dtype, reference64

rng = np.random.default_rng(1)
bad = 0
for d in (64, 128, 40, 96, 256, 192):
    for causal in (False, True):
        for nq, nk in ((200, 333), (333, 200), (64, 64), (1000, 1000)):
            q, k, v = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((1, 3, nq, d), (1, 3, nk, d), (1, 3, nk, d)))
            ref_o, ref_l = reference64(q, k, v, causal=causal)
            nai_o, _ = naive_attention_in_dtype(q, k, v, causal=causal)
            nai_err = np.abs(nai_o.astype(np.float64) - ref_o).max()
            line = [f"d={d:3d} causal={causal!s:5} nq={nq:4d} nk={nk:4d} naive={nai_err:.2e}"]
            for fam in ("auto", "mma_sync"):
                os.environ["CUFLASH_KERNELS"] = fam
                o, lse = cuflash.attention(*(cp.asarray(a.view(np.uint16)).view(ml_dtypes.bfloat16) for a in (q, k, v)),
                                           causal=causal, return_lse=True)
                oh = cp.asnumpy(o.view(cp.uint16)).view(ml_dtypes.bfloat16).astype(np.float64)
                err = np.nanmax(np.abs(oh - ref_o)) if np.isfinite(oh).all() else float("nan")
                lerr = np.abs(cp.asnumpy(lse) - ref_l)
                lerr = np.nanmax(np.where(np.isinf(ref_l), 0, lerr))
                ok = err <= 2 * nai_err + 2**-8 * np.abs(ref_o).max()
                bad += not ok
                line.append(f"{fam}: o {err:.2e} lse {lerr:.2e} {'ok' if ok else 'BAD'}")
            print("  ".join(line), flush=True)

# Backward: both kernel families against the float64 reference gradients (3x naive rule).
from cuflash.testing import assert_backward_within_naive_error, random_inputs, to_numpy  # noqa: E402

for d in (64, 128, 96):
    for causal in (False, "bottom_right", "top_left"):
        for nq, nk in ((200, 333), (333, 200), (64, 64)):
            q, k, v = random_inputs(rng, (1, 4, nq, d), (1, 2, nk, d), ml_dtypes.bfloat16)
            do = random_inputs(rng, (1, 4, nq, d), (1, 4, nq, d), ml_dtypes.bfloat16)[0]
            line = [f"bwd d={d:3d} causal={causal!s:12} nq={nq:4d} nk={nk:4d}"]
            for fam in ("auto", "mma_sync"):
                os.environ["CUFLASH_KERNELS"] = fam
                qg, kg, vg, dog = (cp.asarray(a) for a in (q, k, v, do))
                o, lse = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True)
                grads = tuple(to_numpy(g) for g in cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal))
                try:
                    assert_backward_within_naive_error(grads, do, q, k, v, causal=causal)
                    line.append(f"{fam}: ok")
                except AssertionError as exc:
                    bad += 1
                    line.append(f"{fam}: BAD {str(exc).splitlines()[0][:160]}")
            print("  ".join(line), flush=True)
sys.exit(1 if bad else 0)
