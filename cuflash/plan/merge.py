"""Plans of the log-sum-exp merge of partial attention results (cuda_src/merge.cu): one small
elementwise kernel per (parts dtype, output dtype)."""

from __future__ import annotations

import numpy as np

from ..core.arrays import FLOAT32, KERNEL_TYPE, SUPPORTED_DTYPES
from .spec import KernelSpec

MERGE_THREADS = 256
# Blocks of the grid-stride loop: enough to fill any GPU, few enough that one launch covers any size.
MERGE_MAX_BLOCKS = 65536


def _ctype(dtype) -> str:
    dtype = np.dtype(dtype)
    return "float" if dtype == FLOAT32 else KERNEL_TYPE[dtype]


def merge_spec(parts_dtype, out_dtype) -> KernelSpec:
    """The merge kernel for these dtypes; arithmetic in float for 16-bit parts, double for float32."""
    acc = "double" if np.dtype(parts_dtype) == FLOAT32 else "float"
    expr = f"merge_states<{_ctype(parts_dtype)}, {_ctype(out_dtype)}, {acc}>"
    return KernelSpec("merge.cu", expr, MERGE_THREADS, 0)


def merge_grid(total: int) -> int:
    return max(1, min(MERGE_MAX_BLOCKS, -(-total // MERGE_THREADS)))


def all_merge_specs():
    """Every merge instantiation: each parts dtype with each output dtype."""
    return [merge_spec(a, b) for a in SUPPORTED_DTYPES for b in SUPPORTED_DTYPES]
