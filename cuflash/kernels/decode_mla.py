"""MLA decode launches (attn_decode_mla.cu; plan.decode_mla): the split kernel and, with several
splits, attn_decode_combine over 512-wide partial rows, on CuPy's current stream."""

from __future__ import annotations

import numpy as np

from ..plan import decode_mla
from . import device
from .build import get_function
from .operands import LOG2E as _LOG2E
from .operands import band_offsets, elem_strides, vector_ok


def v_in_k(k4, v4) -> bool:
    """Whether v is k's first 512 columns: the same data pointer and strides (v = k[..., :512]), so
    that the kernel reads each cache row once and takes V from the K tile in shared memory."""
    return (k4.data.ptr == v4.data.ptr and k4.strides == v4.strides and k4.shape[:-1] == v4.shape[:-1]
            and v4.shape[-1] <= k4.shape[-1])


def _rows_ok(a, d) -> bool:
    """16-byte cp.async of a's rows: unit-stride head dim, 16-byte aligned base and strides."""
    return a.strides[-1] == a.itemsize and vector_ok((a,), d)


def forward(p, q4, k4, v4, o4, lse3, kv_lens=None, paged=None, splits=None, waves=None):
    """MLA decode of a validated (576, 512) problem: q4 (B, Hq, Nq, 576); k4 (B, Hkv, Nk, 576) and
    v4 (B, Hkv, Nk, 512) - v4 a view of k4's first 512 columns, or its own array - or, with
    ``paged`` = (block_table, block_size), caches (num_blocks, block_size, Hkv, 576 / 512); o4
    (B, Hq, Nq, 512) and lse3 (B, Hq, Nq) written. ``splits`` forces the split count. Rows that the
    16-byte copies cannot read in place (a strided head dim, unaligned bases or strides) are copied
    first; v then no longer aliases k."""
    import cupy

    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    if not _rows_ok(k4, decode_mla.D) or not _rows_ok(v4, decode_mla.DV):
        alias = v_in_k(k4, v4)
        k4 = cupy.ascontiguousarray(k4)
        v4 = k4[..., :decode_mla.DV] if alias else cupy.ascontiguousarray(v4)
    if q4.strides[-1] != q4.itemsize:
        q4 = cupy.ascontiguousarray(q4)
    o_direct = o4.strides[-1] == o4.itemsize and o4.data.ptr % 4 == 0 and all(s % 4 == 0 for s in o4.strides[:3])
    ow = o4 if o_direct else cupy.empty(o4.shape, dtype=o4.dtype)  # (the kernel stores 4-byte column pairs)
    alias = v_in_k(k4, v4)
    dev = cupy.cuda.Device().id
    plan = decode_mla.launch_plan(p, device.sm_count(dev), splits, waves)
    hkv_launch = p.hkv * plan.row_blocks
    group = p.group // plan.row_blocks
    rows = group * p.nq
    _, _, align = band_offsets(p)
    qs, ks, vs, os_ = elem_strides(q4), elem_strides(k4), elem_strides(v4), elem_strides(ow)
    if paged is not None:  # caches (num_blocks, block_size, Hkv, d): page, head, row strides
        table, bs = paged
        kv = (ks[0], ks[2], ks[1], vs[0], vs[2], vs[1])
        pages = (table, np.int64(table.strides[0] // table.itemsize), np.int32(bs.bit_length() - 1))
    else:
        kv = (ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
        pages = (np.uint64(0), np.int64(0), np.int32(0))
    if plan.splits > 1:
        part_o = cupy.empty((p.batch, hkv_launch, plan.splits, rows, decode_mla.DV), dtype=np.float32)
        part_lse = cupy.empty((p.batch, hkv_launch, plan.splits, rows), dtype=np.float32)
    else:
        part_o = part_lse = np.uint64(0)
    spec = decode_mla.kernel_spec(p.dtype, plan.row_tiles, p.causal is not None, alias)
    lens = kv_lens if kv_lens is not None else np.uint64(0)
    args = (q4, k4, v4, ow, lse3, part_o, part_lse, lens, *pages, *(np.int64(x) for x in qs[:3]),
            *(np.int64(x) for x in kv), *(np.int64(x) for x in os_[:3]), np.int32(p.hq), np.int32(p.nq),
            np.int32(p.nk), np.int32(group), np.int32(align), np.int32(plan.chunk), np.float32(p.scale * _LOG2E),
            np.int32(plan.row_blocks))
    get_function(spec)((plan.splits, hkv_launch, p.batch), (spec.threads,), args, shared_mem=spec.smem_bytes)
    if plan.splits > 1:
        fn = get_function(decode_mla.combine_spec(p.dtype))
        grid = decode_mla.combine_grid(rows, plan.splits, hkv_launch, p.batch)
        fn(grid, (decode_mla.COMBINE_THREADS,),
           (part_o, part_lse, ow, lse3, *(np.int64(x) for x in os_[:3]), np.int32(p.hq), np.int32(hkv_launch),
            np.int32(p.nq), np.int32(group), np.int32(decode_mla.DV), np.int32(plan.splits)))
    if ow is not o4:
        o4.view(np.uint16)[...] = ow.view(np.uint16)  # (through the bits: CuPy stores bfloat16 only)
