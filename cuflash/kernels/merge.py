"""Launch of the log-sum-exp merge (cuda_src/merge.cu) on CuPy's current stream."""

from __future__ import annotations

import numpy as np

from ..plan.merge import MERGE_THREADS, merge_grid, merge_spec
from .build import get_function
from .operands import elem_strides


def launch(o5, lse4, out4, lse_out3):
    """o5 (P, B, H, N, d) parts, lse4 (P, B, H, N) float32 -> out4 (B, H, N, d), lse_out3 (B, H, N)
    float32; any strides."""
    parts, b, h, n, d = o5.shape
    total = b * h * n * d
    if total == 0:
        return
    spec = merge_spec(o5.dtype, out4.dtype)
    strides = [np.int64(s) for a in (o5, lse4, out4, lse_out3) for s in elem_strides(a)]
    get_function(spec)((merge_grid(total),), (MERGE_THREADS,),
                       (o5, lse4, out4, lse_out3, np.int32(parts), np.int32(h), np.int32(n), np.int32(d),
                        np.int64(total), *strides))
