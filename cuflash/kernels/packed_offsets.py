"""Launch of the packed offsets' clamp (cuda_src/packed_offsets.cu) on CuPy's current stream."""

from __future__ import annotations

import numpy as np

from ..plan.packed import clamp_offsets_spec
from .build import get_function


def clamp(cu_q, cu_k, total_q: int, total_k: int):
    """(cu_q', cu_k'): device int32 copies of contiguous offsets with every sequence inside the
    packed arrays of total_q / total_k rows (clamped into [0, total], non-decreasing); offsets that
    already are stay unchanged. Needs no host read, so a CUDA graph can capture it."""
    import cupy

    n = cu_q.shape[0]
    out = cupy.empty((2, n), dtype=np.int32)
    spec = clamp_offsets_spec()
    get_function(spec)((2,), (spec.threads,), (cu_q, cu_k, out[0], out[1], np.int32(n), np.int32(total_q),
                                               np.int32(total_k)))
    return out[0], out[1]
