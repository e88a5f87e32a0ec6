"""CUDA backend: plan a launch for a validated problem and run it on CuPy's current stream."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core import masks
from ..plan import schedule
from ..core.arrays import BFLOAT16, FLOAT16, FLOAT32, KERNEL_TYPE
from .build import KernelSpec, get_function

_MAX_GRID_Z = 65535
_LOG2E = 1.4426950408889634
OPEN = 2**31 - 1  # an open side of the band kernels' mask; they clamp it to the sequence


def _elem_strides(a4):
    return tuple(s // a4.itemsize for s in a4.strides)


def _unit_d(a4):
    """The kernels read rows contiguously: copy an input whose head dim is strided (documented)."""
    if a4.shape[-1] > 1 and a4.strides[-1] != a4.itemsize:
        import cupy

        return cupy.ascontiguousarray(a4)
    return a4


def _vector_ok(arrays, d) -> bool:
    """16-byte cp.async/stores need d % 8 == 0, 16-byte aligned bases and row strides % 8 == 0."""
    if d % 8:
        return False
    for a in arrays:
        if a.data.ptr % 16:
            return False
        if any(s % 8 for n, s in zip(a.shape[:3], _elem_strides(a)[:3]) if n > 1):
            return False
    return True


def forward_spec(dtype, d: int, causal: bool, vec: bool, tile=None, band: bool = False):
    """(KernelSpec, TileConfig) of the forward kernel for these runtime choices.

    ``band``: the sliding-window / packed-sequence kernel attn_fwd_band (16-bit only; ``causal``
    is then ignored, the bounds are run-time arguments). The compile check instantiates exactly
    these, so what CI compiles is what runs."""
    dtype = np.dtype(dtype)
    if dtype == FLOAT32:
        if band:
            raise NotImplementedError(_FP32_BAND)
        from .fp32 import forward_spec_fp32

        return forward_spec_fp32(d, causal, vec, tile)
    hd, t = schedule.forward_tile(d, vec)
    if band and tile is None and hd in _BAND_BLOCK_N:
        t = dataclasses.replace(t, block_n=_BAND_BLOCK_N[hd], reason=f"band kernel: {_BAND_BLOCK_N[hd]}-key tiles")
    t = tile or t
    head = f"{KERNEL_TYPE[dtype]}, {hd}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}"
    if band:
        expr = f"attn_fwd_band<{head}, {_b(vec)}, {_b(t.lazy_rescale)}>"
    else:
        expr = f"attn_fwd<{head}, {_b(causal)}, {_b(vec)}" + ("" if t.lazy_rescale else ", false") + ">"
    return KernelSpec("attn_fwd.cu", expr, t.threads, t.smem_bytes(hd)), t


# The band kernel keeps its bounds and sequence lengths in registers (the plain kernels read nk and
# the causal offset from kernel parameters): at d = 192 the table's 64-key tile then spills
# (255 registers + 32 bytes), the 32-key tile fits (239).
_BAND_BLOCK_N = {192: 32}

_FP32_BAND = ("cuflash: window= and cu_seqlens_q= / cu_seqlens_k= are not implemented for float32 GPU inputs "
              "(float16/bfloat16 run them on the GPU; NumPy inputs run the CPU backend)")


def _b(x: bool) -> str:
    return "true" if x else "false"


def all_forward_specs():
    """Every forward instantiation the package can launch: what CI compiles for sm_90a."""
    from .fp32 import all_forward_specs_fp32

    specs = all_forward_specs_fp32()
    for dtype in (FLOAT16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for causal in (False, True):
                for vec in (False, True):
                    specs.append(forward_spec(dtype, hd, causal, vec)[0])
            for vec in (False, True):
                specs.append(forward_spec(dtype, hd, True, vec, band=True)[0])
    return list(dict.fromkeys(specs))


def band_offsets(p):
    """(hi, lo, align) for the band kernels: masks.row_bounds relative to the diagonal (rows see
    keys diag + lo .. diag + hi), an open side as +-OPEN; align: the diagonal is i + nk - nq of
    each sequence (bottom-right), else i (top-left)."""
    lo, hi = masks.row_bounds(p.causal, p.window, 0, 0)  # nq = nk = 0: offsets from the diagonal
    return (OPEN if hi is None else hi), (-OPEN if lo is None else lo), int(p.causal != "top_left")


def forward(p, q4, k4, v4, o4, lse3, *, tile=None):
    """o4 (B, Hq, Nq, d) and lse3 (B, Hq, Nq) float32 receive the result.

    `tile` overrides the table's TileConfig (schedule search and benchmarks)."""
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    qu, ku, vu = _unit_d(q4), _unit_d(k4), _unit_d(v4)
    if tile is None:
        from . import decode

        if decode.applies(p, ku, vu):  # few query rows per K/V head, long cache: split-KV (any band)
            decode.forward(p, qu, ku, vu, o4, lse3)
            return
    if p.window is not None:  # the band kernels (wgmma on sm_90)
        forward_band(p, q4, k4, v4, o4, lse3, tile=tile)
        return
    q4, k4, v4 = qu, ku, vu
    if o4.strides[-1] != o4.itemsize and p.d > 1:
        raise ValueError("out: the head dim must have unit stride")
    vec = _vector_ok((q4, k4, v4, o4), p.d)
    if tile is None:
        from . import hopper

        if hopper.applies(p, vec):  # sm_90: the wgmma kernel (its autotuned tile when CUFLASH_TUNE asks)
            from ..tune import pick_hopper_forward_tile

            tuned = pick_hopper_forward_tile(p)
            if tuned is not None and tuned.tma and not hopper.tma_ok(q4, k4, v4):
                tuned = None  # a TMA winner, rows TMA cannot address: the cp.async kernel's tile
            hopper.forward(p, q4, k4, v4, o4, lse3, tile=tuned)
            return
    if tile is None and vec:  # autotuned winner when CUFLASH_TUNE asks for it, else the table
        from ..tune import pick_forward_tile

        tile = pick_forward_tile(p)
    spec, tile = forward_spec(p.dtype, p.d, p.causal is not None, vec, tile)
    launch_forward(spec, tile.block_m, p, q4, k4, v4, o4, lse3)


def launch_forward(spec, block_m, p, q4, k4, v4, o4, lse3, maps=None, persistent_blocks=None, blocks=None,
                   extra_args=()):
    """One launch per chunk of at most 65535 batch entries; grid (query tiles, heads, batch).
    `maps(q, k, v)`, if given, returns the chunk's tensor maps, passed before the pointers.
    `persistent_blocks` (a persistent kernel): a 1-D grid of at most that many blocks walks the
    chunk's query tiles; the head and batch counts follow the other arguments. `blocks` (the key
    split kernel, one chunk): a 1-D grid of that many blocks, `extra_args` after the plain ones."""
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
        if blocks is not None:
            fn((blocks,), (spec.threads,), args + tuple(extra_args), shared_mem=spec.smem_bytes)
        elif persistent_blocks:  # work units: query tiles, or under a causal mask pairs of them
            work = (-(-m_blocks // 2) if p.causal is not None else m_blocks) * p.hq * (b1 - b0)
            fn((max(1, min(work, persistent_blocks)),), (spec.threads,), args + (np.int32(p.hq), np.int32(b1 - b0)),
               shared_mem=spec.smem_bytes)
        else:
            fn((m_blocks, p.hq, b1 - b0), (spec.threads,), args, shared_mem=spec.smem_bytes)


def forward_band(p, q4, k4, v4, o4, lse3, *, cu_seqlens=None, max_seqlen_q=None, tile=None):
    """Sliding window and/or packed sequences on attn_fwd_band (every GPU, 16-bit inputs), or on
    sm_90 where hopper.applies (and no ``tile`` is given) on attn_fwd_wgmma_band.

    Uniform batch: as :func:`forward`. Packed (``cu_seqlens=(cu_q, cu_k)``, device int32 arrays
    of B + 1 offsets): q4, k4, v4, o4 are (1, H, total, d) views of the packed arrays, lse3 is
    (1, Hq, total_q), and ``max_seqlen_q`` (a host int: the grid covers the longest sequence) is
    required; one launch serves every sequence (grid z), a block past its sequence returns."""
    if np.dtype(p.dtype) == FLOAT32:
        raise NotImplementedError(_FP32_BAND)
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    q4, k4, v4 = _unit_d(q4), _unit_d(k4), _unit_d(v4)
    if o4.strides[-1] != o4.itemsize and p.d > 1:
        raise ValueError("out: the head dim must have unit stride")
    vec = _vector_ok((q4, k4, v4, o4), p.d)
    from . import hopper

    if tile is None and hopper.applies(p, vec):  # same arguments, grid and lse layout
        spec, t = hopper.forward_band_spec(p.dtype, p.d)
    else:
        spec, t = forward_spec(p.dtype, p.d, True, vec, tile, band=True)
    fn = get_function(spec)
    hi, lo, align = band_offsets(p)
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
            args = (q4[b0:b1], k4[b0:b1], v4[b0:b1], o4[b0:b1], lse3[b0:b1], *head, np.uint64(0), np.uint64(0))
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
        args = (q4, k4, v4, o4, lse3, *head, cu_q[s0:], cu_k[s0:])
        fn((m_blocks, p.hq, s1 - s0), (spec.threads,), args, shared_mem=spec.smem_bytes)


def backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, **band):
    from . import backward as gpu_backward

    gpu_backward.backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, deterministic=deterministic, **band)
