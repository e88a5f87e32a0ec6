"""Forward launches of the kernels that share attn_fwd's arguments: the portable mma.sync kernel
(cuda_src/attn_fwd.cu), the float32 kernels, the wgmma kernels (through cuflash.kernels.hopper),
and the band kernels (sliding window and/or packed sequences) of a plan.dispatch.ForwardPlan."""

from __future__ import annotations

import numpy as np

from ..plan.dispatch import ForwardPlan
from ..plan.hopper import persistent_units
from .build import get_function
from .operands import LOG2E as _LOG2E
from ..plan.device_limits import MAX_GRID_YZ as _MAX_GRID_Z
from .operands import band_offsets, score_mod_args, sink_pointer
from .operands import elem_strides as _elem_strides


def launch_forward(spec, block_m, p, q4, k4, v4, o4, lse3, maps=None, persistent_blocks=None, blocks=None,
                   extra_args=(), chunk_args=None):
    """One launch per chunk of at most 65535 batch entries; grid (query tiles, heads, batch).
    `maps(q, k, v)`, if given, returns the chunk's tensor maps, passed before the pointers.
    `persistent_blocks` (a persistent kernel): a 1-D grid of at most that many blocks walks the
    chunk's query tiles; the head and batch counts follow the other arguments. `blocks` (the key
    split kernel, one chunk): a 1-D grid of that many blocks, `extra_args` after the plain ones.
    `chunk_args(first batch entry)` (the score-modifier kernels): a chunk's arguments after the
    plain ones (a persistent kernel's: after its head and batch counts)."""
    fn = get_function(spec)
    off = p.causal_offset if p.causal is not None else 0
    # (float32 inputs: attn_fwd_f32 computes in float64 and takes the scale as a double, so that
    # its only rounding is the final one)
    scale_log2 = (np.float64 if p.dtype == np.float32 else np.float32)(p.scale * _LOG2E)
    m_blocks = -(-p.nq // block_m)
    for b0 in range(0, p.batch, _MAX_GRID_Z):
        b1 = min(p.batch, b0 + _MAX_GRID_Z)
        qs, ks, vs, os_ = (a[b0:b1] for a in (q4, k4, v4, o4))
        ls = lse3[b0:b1]
        strides = []
        for a in (qs, ks, vs, os_):
            sb, sh, sn, _ = _elem_strides(a)
            strides += [np.int64(sb), np.int64(sh), np.int64(sn)]
        args = (*(maps(qs, ks, vs) if maps else ()), qs, ks, vs, os_, ls, *strides, np.int32(p.nq), np.int32(p.nk), np.int32(p.d),
                np.int32(p.group), np.int32(off), scale_log2)
        tail = tuple(chunk_args(b0)) if chunk_args is not None else ()
        if blocks is not None:
            fn((blocks,), (spec.threads,), args + tuple(extra_args), shared_mem=spec.smem_bytes)
        elif persistent_blocks:  # work units: query tiles, or under a causal mask pairs of them
            work = persistent_units(p.nq, block_m, p.causal is not None, p.hq, b1 - b0)
            fn((max(1, min(work, persistent_blocks)),), (spec.threads,),
               args + (np.int32(p.hq), np.int32(b1 - b0)) + tail, shared_mem=spec.smem_bytes)
        else:
            fn((m_blocks, p.hq, b1 - b0), (spec.threads,), args + tail, shared_mem=spec.smem_bytes)


def launch_band(plan: ForwardPlan, p, q4, k4, v4, o4, lse3, *, cu_seqlens=None, max_seqlen_q=None):
    """A "band" or "wgmma_band" plan. Uniform batch: one launch per chunk of batch entries. Packed
    (``cu_seqlens=(cu_q, cu_k)``, device int32 arrays of B + 1 offsets): q4, k4, v4, o4 are
    (1, H, total, d) views of the packed arrays, lse3 is (1, Hq, total_q), and ``max_seqlen_q`` (a
    host int: the grid covers the longest sequence) is required; one launch serves every sequence
    (grid z), a block past its sequence returns."""
    spec, t = plan.spec, plan.tile
    fn = get_function(spec)
    hi, lo, align = band_offsets(p)
    modified = getattr(p, "modified", False)  # attn_fwd_band_mod: the modifiers' arguments follow

    def mod_args(first):
        return (*score_mod_args(p, first), sink_pointer(p)) if modified else ()
    strides = []
    for a in (q4, k4, v4, o4):
        strides += [np.int64(s) for s in _elem_strides(a)[:3]]
    head = (*strides, np.int32(p.nq), np.int32(p.nk), np.int32(p.d), np.int32(p.group), np.int32(hi),
            np.float32(p.scale * _LOG2E), np.int32(lo), np.int32(align))
    if cu_seqlens is None:
        m_blocks = -(-p.nq // t.block_m)
        for b0 in range(0, p.batch, _MAX_GRID_Z):
            b1 = min(p.batch, b0 + _MAX_GRID_Z)
            # A batch slice moves the base pointers: the kernel indexes lse by (b, h) of its chunk.
            args = (q4[b0:b1], k4[b0:b1], v4[b0:b1], o4[b0:b1], lse3[b0:b1], *head, np.uint64(0), np.uint64(0),
                    *mod_args(b0))
            fn((m_blocks, p.hq, b1 - b0), (spec.threads,), args, shared_mem=spec.smem_bytes)
        return
    if max_seqlen_q is None:
        raise ValueError("max_seqlen_q: required with cu_seqlens (the grid covers the longest sequence)")
    cu_q, cu_k = cu_seqlens
    m_blocks = -(-int(max_seqlen_q) // t.block_m)
    n_seq = cu_q.shape[0] - 1
    if m_blocks == 0 or n_seq == 0:
        return
    for s0 in range(0, n_seq, _MAX_GRID_Z):
        s1 = min(n_seq, s0 + _MAX_GRID_Z)
        args = (q4, k4, v4, o4, lse3, *head, cu_q[s0:], cu_k[s0:], *mod_args(s0))
        fn((m_blocks, p.hq, s1 - s0), (spec.threads,), args, shared_mem=spec.smem_bytes)
