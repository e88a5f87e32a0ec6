"""The e4m3 forward's launch (attn_fwd_wgmma_tma_fp8 and, for windows and packed sequences,
attn_fwd_wgmma_tma_fp8_band in cuda_src/attn_fwd_wgmma.cu, sm_90a) of a plan.dispatch.ForwardPlan:
vt, V transposed by fp8_pack_vt (cuda_src/fp8_vt.cu), the byte tensor maps of q, k and vt, and the
descales' pointers and strides.

The arrays are CuPy uint8 views of the e4m3 bits (core.fp8_inputs); the kernels only move and
multiply the bits. vt (B, Hkv, d, Nk rounded up to 32) is built on every call, on the call's
stream, and freed with it: a pass over V that every timing of the kernel includes. Packed
sequences' vt is that of the (1, Hkv, total_k, d) array, one sequence of total_k keys: the band
kernel starts each sequence's key tiles at the 32-key group of its first key and masks the keys
before it (no per-sequence padding or offsets)."""

from __future__ import annotations

import numpy as np

from ..plan import hopper as plan_hopper
from ..plan.device_limits import MAX_GRID_YZ
from ..plan.dispatch import ForwardPlan
from ..plan.hopper import persistent_units, vt_keys
from ..plan.schedule import fp8_head_dim
from . import device, tma
from .build import get_function
from .operands import LOG2E, band_offsets, elem_strides, tma_ok

# vt's key order within each group of 32 (cuda_src/fp8_keys.cuh's kFp8KeyOfPos): position p holds
# key KEY_OF_POS[p]. The e4m3 P fragment takes keys in this order (hopper/fwd_fp8.cuh).
KEY_OF_POS = tuple((p & 16) | (((p >> 2) & 3) << 1) | (p & 1) | (((p >> 1) & 1) << 3) for p in range(32))


def _aligned16(a4) -> bool:
    return a4.data.ptr % 16 == 0 and all(s % 16 == 0 for n, s in zip(a4.shape[:3], a4.strides[:3]) if n > 1)


def pack_vt(v4):
    """vt of a (B, H, Nk, d) uint8 view with unit-stride rows: (B, H, d, vt_keys(Nk)) uint8, each
    row a column of V with its keys in KEY_OF_POS order, zeros past Nk."""
    import cupy

    b, h, nk, d = v4.shape
    nk_pad = vt_keys(nk)
    vt = cupy.empty((b, h, d, nk_pad), dtype=np.uint8)
    if vt.size == 0:
        return vt
    fn = get_function(plan_hopper.fp8_vt_spec(d % 16 == 0 and _aligned16(v4)))
    sb, sh, sn = (np.int64(s) for s in v4.strides[:3])  # (bytes = elements)
    grid_xy = (-(-nk_pad // plan_hopper.FP8_VT_KEYS), -(-d // plan_hopper.FP8_VT_COLS))
    for bh0 in range(0, b * h, MAX_GRID_YZ):
        n = min(MAX_GRID_YZ, b * h - bh0)
        fn(grid_xy + (n,), (plan_hopper.FP8_VT_THREADS,),
           (v4, vt, sb, sh, sn, np.int32(h), np.int32(nk), np.int32(nk_pad), np.int32(d), np.int32(bh0)))
    return vt


def vt_map(vt4, head_dim: int):
    """Rank-4 map (keys, d, heads, batch) of vt with 128-key x head_dim-row boxes (one column block
    of the kernel's V slot; rows past d read as zero)."""
    b, h, d, n = vt4.shape
    return tma.tiled_map(np.uint8, vt4.data.ptr, (n, d, h, b), tma.bhsd_strides(vt4), (128, head_dim, 1, 1))


def tma_input(a4):
    """q or k as the kernel's tensor maps read it: a4 itself when TMA can address it, else a
    contiguous copy with d padded to a multiple of 16 bytes (zero columns change no score)."""
    if tma_ok(a4):
        return a4
    import cupy

    d16 = -(-a4.shape[3] // 16) * 16
    c = cupy.zeros(a4.shape[:3] + (d16,), dtype=np.uint8)
    c[..., : a4.shape[3]] = a4
    return c


def scale_args(descale, batch: int, heads: int, q_heads: int | None = None):
    """(pointer or null, batch stride, head stride[, K/V-head stride]) of one descale, in float32
    elements (a per-tensor factor: strides 0; None: a null pointer, read as 1). q (``q_heads`` =
    Hq): a per-K/V-head factor (FlashAttention-3's) is indexed by the K/V head instead."""
    if descale is None or descale.ndim == 0 or descale.shape == (1,):
        return (np.uint64(0) if descale is None else descale), 0, 0, 0
    d2 = descale.reshape(batch, descale.shape[-1])
    sb, sh = (int(s) // 4 for s in d2.strides)
    sb = 0 if batch == 1 else sb
    if q_heads is not None and d2.shape[1] != q_heads:
        return d2, sb, 0, sh  # q per K/V head
    return d2, sb, sh, 0


def launch(plan: ForwardPlan, p, q4, k4, v4, o4, lse3, descales, *, cu_seqlens=None, max_seqlen_q=None,
           persistent_blocks=None):
    """One launch per chunk of at most MAX_GRID_YZ batch entries; grid (query tiles, heads, batch),
    or (a persistent tile) one launch of a 1-D grid of at most one block per SM (or
    ``persistent_blocks``) walking every work unit, the head and batch counts after the descales.
    q4, k4: uint8 (B, H, N, d) views TMA can address (tma_input); v4: any uint8 view with unit-
    stride rows; o4: 16-bit, rows 16-byte aligned with d % 8 == 0; descales: (q, k, v), each
    None or a checked float32 array. A "wgmma_fp8_band" plan takes the window's bounds (p.window,
    p.causal) and, packed (``cu_seqlens=(cu_q, cu_k)``, device int32 offsets of B + 1 entries),
    (1, H, total, d) views with lse3 (1, Hq, total_q), per-tensor descales and ``max_seqlen_q``
    (a host int: the grid covers the longest sequence); one launch per chunk of sequences."""
    t, spec = plan.tile, plan.spec
    band = plan.kernel == "wgmma_fp8_band"
    if cu_seqlens is not None and (not band or max_seqlen_q is None):
        raise ValueError("cu_seqlens: packed sequences need the band plan and max_seqlen_q")
    hd = fp8_head_dim(p.d)
    vt = pack_vt(v4)
    fn = get_function(spec)
    scale_log2 = np.float32(p.scale * LOG2E)
    dq, dk, dv = descales
    qa = scale_args(dq, p.batch, p.hq, q_heads=p.hq)
    ka, va = scale_args(dk, p.batch, p.hkv), scale_args(dv, p.batch, p.hkv)
    strides = tuple(np.int32(x) for x in (qa[1], qa[2], qa[3], ka[1], ka[2], va[1], va[2]))
    if band:  # (the kernel's parameters after group: hi, scale_log2, lo, align, cu_q, cu_k)
        hi, lo, align = band_offsets(p)
        bounds = (np.int32(hi), scale_log2, np.int32(lo), np.int32(align))
    else:
        bounds = (np.int32(p.causal_offset if p.causal is not None else 0), scale_log2)

    def run(grid, qs, ks, vts, os_, ls, b0, offsets, tail=()):
        maps = (tma.bhsd_map(qs, t.block_m), tma.bhsd_map(ks, t.block_n), vt_map(vts, hd))
        ptrs = [a[0] if a[1] == 0 or isinstance(a[0], np.uint64) else a[0][b0:] for a in (qa, ka, va)]
        o_sb, o_sh, o_sn, _ = elem_strides(os_)
        args = (*maps, os_, ls, np.int64(o_sb), np.int64(o_sh), np.int64(o_sn), np.int32(p.nq), np.int32(p.nk),
                np.int32(p.d), np.int32(p.group), *bounds, *offsets, *ptrs, *strides, *tail)
        fn(grid, (spec.threads,), args, shared_mem=spec.smem_bytes)

    if t.persistent:  # (the plain kernel only: _fp8_tile keeps the band kernel per tile)
        units = persistent_units(p.nq, t.block_m, p.causal is not None, p.hq, p.batch)
        blocks = persistent_blocks or device.sm_count(device.current_id())
        run((max(1, min(units, blocks)),), q4, k4, vt, o4, lse3, 0, (), (np.int32(p.hq), np.int32(p.batch)))
        return

    if cu_seqlens is not None:  # every sequence in the packed arrays: grid z counts sequences
        cu_q, cu_k = cu_seqlens
        m_blocks, n_seq = -(-int(max_seqlen_q) // t.block_m), cu_q.shape[0] - 1
        for s0 in range(0, n_seq if m_blocks else 0, MAX_GRID_YZ):
            s1 = min(n_seq, s0 + MAX_GRID_YZ)
            run((m_blocks, p.hq, s1 - s0), q4, k4, vt, o4, lse3, 0, (cu_q[s0:], cu_k[s0:]))
        return
    m_blocks = -(-p.nq // t.block_m)
    null = (np.uint64(0), np.uint64(0)) if band else ()
    for b0 in range(0, p.batch, MAX_GRID_YZ):
        b1 = min(p.batch, b0 + MAX_GRID_YZ)
        run((m_blocks, p.hq, b1 - b0), q4[b0:b1], k4[b0:b1], vt[b0:b1], o4[b0:b1], lse3[b0:b1], b0, null)
