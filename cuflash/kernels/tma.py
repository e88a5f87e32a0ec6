"""Tensor maps for the bulk tensor copy engine (TMA): encoded on the host through cuda-bindings'
cuTensorMapEncodeTiled, passed to kernels by value as a 128-byte struct (CuPy passes a NumPy
structured scalar as a by-value parameter).

Encoding costs a driver call, so maps are cached by everything they encode (address, extents,
strides, box): a decode loop over the same cache arrays encodes once."""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import numpy as np

from ..core.arrays import BFLOAT16, FLOAT16

# The device struct TmaDesc (cuda_src/tma.cuh): 16 opaque 64-bit words.
TMAP_DTYPE = np.dtype({"names": ["opaque"], "formats": [("<u8", (16,))]})
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 256


def available() -> bool:
    """cuda-bindings (the driver API from Python) is installed."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def encodable(ptr: int, strides_bytes) -> bool:
    """TMA needs a 16-byte aligned base and byte strides that are multiples of 16."""
    return ptr % 16 == 0 and all(s % 16 == 0 and 0 < s < 2**40 for s in strides_bytes)


def tiled_map(dtype, ptr: int, dims, strides_bytes, box):
    """A 128-byte-swizzled tiled map of a rank-len(dims) tensor of 16-bit elements, or of bytes
    (uint8: the e4m3 forward's inputs, whose bits TMA only copies).

    dims: extents, innermost (contiguous) first; strides_bytes: the byte strides of dims[1:];
    box: the box extents (box[0] * itemsize must be <= 128). Out-of-range elements read as zero."""
    key = (np.dtype(dtype).str, ptr, tuple(dims), tuple(strides_bytes), tuple(box))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    from cuda.bindings import driver as cu

    kind = {
        np.dtype(FLOAT16): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        np.dtype(BFLOAT16): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        np.dtype(np.uint8): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }[np.dtype(dtype)]
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        kind, len(dims), ptr, [u64(int(x)) for x in dims], [u64(int(x)) for x in strides_bytes],
        [u32(int(x)) for x in box], [u32(1)] * len(dims), cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for dims {dims}, strides {strides_bytes}, box {box}")
    raw = ctypes.string_at(tmap.getPtr(), TMAP_DTYPE.itemsize)
    arg = np.frombuffer(raw, dtype=np.uint64).copy().view(TMAP_DTYPE)
    _CACHE[key] = arg
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return arg


def bhsd_strides(a4):
    """Byte strides of (row, head, batch) of a (B, H, N, d) view; an axis of extent 1 gets a
    nominal stride (TMA wants every stride a positive multiple of 16; that axis is never stepped)."""
    out = []
    for n, s in zip((a4.shape[2], a4.shape[1], a4.shape[0]), (a4.strides[2], a4.strides[1], a4.strides[0])):
        out.append(s if n > 1 else 16 * max(1, a4.shape[3] * a4.itemsize // 16))
    return out


def bhsd_map(a4, box_rows: int):
    """Rank-4 map (d, rows, heads, batch) of a (B, H, N, d) CuPy view with 128-byte x box_rows
    boxes (64 16-bit or 128 byte columns): one box is one column block of a cuda_src Sw128Tile."""
    b, h, n, d = a4.shape
    return tiled_map(a4.dtype, a4.data.ptr, (d, n, h, b), bhsd_strides(a4), (128 // a4.itemsize, box_rows, 1, 1))
