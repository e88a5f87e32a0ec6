"""Split-KV decoding on the GPU: plan (row packing, number of splits) and launch.

Used for 16-bit inputs when all query rows that share a K/V head (GQA group x new tokens) fit in
the decode tile's packed rows. Everything else takes the prefill kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import schedule
from ._arrays import BFLOAT16, FLOAT16
from ._build import KernelSpec, get_function

_TAG = {FLOAT16: "Fp16", BFLOAT16: "Bf16"}
_LOG2E = 1.4426950408889634
_COMBINE_THREADS = 128
MIN_KEYS = 256  # below this a single prefill tile loop is as good


def _b(x):
    return "true" if x else "false"


def row_tiles_for(p):
    """16-row mma tiles for the packed (head, token) rows, or None if decode doesn't apply."""
    if p.dtype not in _TAG:
        return None
    hd, t = schedule.decode_tile(p.d)
    tiles = -(-(p.group * p.nq) // 16)
    return tiles if tiles <= t.max_row_tiles else None


def applies(p, k4, v4) -> bool:
    """Decode needs few query rows per K/V head, a long cache and 16-byte loads of K and V
    (unaligned caches take the prefill kernel, whose scalar-load path handles them)."""
    from .gpu import _vector_ok

    return p.nq <= 16 and p.nk >= MIN_KEYS and row_tiles_for(p) is not None and _vector_ok((k4, v4), p.d)


def decode_specs(dtype, d, row_tiles, causal, vec, tile=None):
    hd, t = schedule.decode_tile(d)
    t = tile or t
    # More packed rows mean a taller S tile: shrink the key tile to keep S's registers constant.
    # (a power of two, at least one 16-key mma step)
    bn = t.block_n
    while bn > 16 and bn * row_tiles > 2 * t.block_n:
        bn //= 2
    t = dataclasses.replace(t, block_n=bn)
    tag = _TAG[np.dtype(dtype)]
    main = KernelSpec(
        "attn_decode.cu",
        f"attn_decode<{tag}, {hd}, {row_tiles}, {t.block_n}, {t.warps}, {t.stages}, {_b(causal)}, {_b(vec)}>",
        t.threads,
        t.smem_bytes(hd, row_tiles),
    )
    combine = KernelSpec("attn_decode.cu", f"attn_decode_combine<{tag}, {hd}>", _COMBINE_THREADS, 0)
    return main, combine, hd, t


def all_decode_specs():
    specs = []
    for dtype in (FLOAT16, BFLOAT16):
        for hd, t in schedule.DECODE_TILES.items():
            for rt in range(1, t.max_row_tiles + 1):
                for causal in (False, True):
                    main, combine, _, _ = decode_specs(dtype, hd, rt, causal, True)
                    specs += [main, combine]
    return list(dict.fromkeys(specs))


WAVES = 2  # blocks per SM the split count aims for


def num_splits(p, tile, sm_count: int, waves: int | None = None) -> int:
    """Enough blocks for about `waves` blocks per SM, each warp keeping >= 4 tiles."""
    blocks = max(1, p.batch * p.hkv)
    want = -(-(waves or WAVES) * sm_count // blocks)
    per_split_min = tile.warps * tile.block_n * 4
    return max(1, min(want, -(-p.nk // per_split_min)))


def plan(p, sm_count: int, splits=None, tile=None, waves=None):
    """(row_tiles, tile, splits, chunk): the launch's geometry. Each split covers `chunk` keys, a
    whole number of key tiles; the accounting reads the split count from here too."""
    rt = row_tiles_for(p)
    _, _, _, t = decode_specs(p.dtype, p.d, rt, p.causal is not None, True, tile)
    splits = splits or num_splits(p, t, sm_count, waves)
    chunk = -(-max(p.nk, 1) // splits)
    chunk = -(-chunk // t.block_n) * t.block_n
    return rt, t, -(-max(p.nk, 1) // chunk), chunk


def workspace_bytes(p, splits: int) -> int:
    """Partial O (float32, d per row) and LSE per split; nothing with one split."""
    if splits <= 1:
        return 0
    rows = p.batch * p.hkv * splits * p.group * p.nq
    return rows * p.d * 4 + rows * 4


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """Multiprocessors of a device, read once (Device.attributes queries every attribute)."""
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


def forward(p, q4, k4, v4, o4, lse3, kv_lens=None, splits=None, tile=None, waves=None):
    import cupy

    from .gpu import _elem_strides

    sm = _sm_count(cupy.cuda.Device().id)
    rt, t, splits, chunk = plan(p, sm, splits, tile, waves)
    main, combine, hd, t = decode_specs(p.dtype, p.d, rt, p.causal is not None, True, tile)
    rows = p.group * p.nq
    if splits > 1:
        part_o = cupy.empty((p.batch, p.hkv, splits, rows, p.d), dtype=np.float32)
        part_lse = cupy.empty((p.batch, p.hkv, splits, rows), dtype=np.float32)
    else:
        part_o = part_lse = cupy.empty((0,), dtype=np.float32)
    lens = kv_lens if kv_lens is not None else cupy.empty((0,), dtype=np.int32)
    strides = []
    for a in (q4, k4, v4, o4):
        strides += [np.int64(s) for s in _elem_strides(a)[:3]]
    lens_ptr = lens if kv_lens is not None else np.uint64(0)
    get_function(main)(
        (splits, p.hkv, p.batch), (t.threads,),
        (q4, k4, v4, o4, lse3, part_o, part_lse, lens_ptr, *strides,
         np.int32(p.hq), np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group),
         np.int32(p.causal == "bottom_right"), np.int32(chunk), np.float32(p.scale * _LOG2E)),
        shared_mem=main.smem_bytes,
    )
    if splits > 1:
        get_function(combine)(
            (rows, p.hkv, p.batch), (_COMBINE_THREADS,),
            (part_o, part_lse, o4, lse3, *[np.int64(s) for s in _elem_strides(o4)[:3]],
             np.int32(p.hq), np.int32(p.hkv), np.int32(p.nq), np.int32(p.group), np.int32(p.d), np.int32(splits)),
        )
