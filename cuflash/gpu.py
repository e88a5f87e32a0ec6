"""CUDA backend: plan a launch for a validated problem and run it on CuPy's current stream."""

from __future__ import annotations

import numpy as np

from . import schedule
from ._arrays import BFLOAT16, FLOAT16, FLOAT32
from ._build import KernelSpec, get_function

_MAX_GRID_Z = 65535
_LOG2E = 1.4426950408889634


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


_TYPE_TAG = {FLOAT16: "Fp16", BFLOAT16: "Bf16"}


def forward_spec(dtype, d: int, causal: bool, vec: bool, tile=None):
    """(KernelSpec, TileConfig) of the forward kernel for these runtime choices.

    The compile check instantiates exactly these, so what CI compiles is what runs."""
    dtype = np.dtype(dtype)
    if dtype == FLOAT32:
        from .gpu_fp32 import forward_spec_fp32

        return forward_spec_fp32(d, causal, vec)
    hd, t = schedule.forward_tile(d, vec)
    t = tile or t
    expr = (
        f"attn_fwd<{_TYPE_TAG[dtype]}, {hd}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, "
        f"{'true' if causal else 'false'}, {'true' if vec else 'false'}"
        + ("" if t.lazy_rescale else ", false")
        + ">"
    )
    return KernelSpec("attn_fwd.cu", expr, t.threads, t.smem_bytes(hd)), t


def all_forward_specs():
    """Every forward instantiation the package can launch: what CI compiles for sm_90a."""
    specs = []
    for dtype in (FLOAT16, BFLOAT16, FLOAT32):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for causal in (False, True):
                for vec in (False, True):
                    specs.append(forward_spec(dtype, hd, causal, vec)[0])
    return list(dict.fromkeys(specs))


def forward(p, q4, k4, v4, o4, lse3, *, tile=None):
    """o4 (B, Hq, Nq, d) and lse3 (B, Hq, Nq) float32 receive the result.

    `tile` overrides the table's TileConfig (schedule search and benchmarks)."""
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    q4, k4, v4 = _unit_d(q4), _unit_d(k4), _unit_d(v4)
    if tile is None:
        from . import gpu_decode

        if gpu_decode.applies(p, k4, v4):  # few query rows per K/V head, long cache: split-KV
            gpu_decode.forward(p, q4, k4, v4, o4, lse3)
            return
    if o4.strides[-1] != o4.itemsize and p.d > 1:
        raise ValueError("out: the head dim must have unit stride")
    vec = _vector_ok((q4, k4, v4, o4), p.d)
    if tile is None:
        from . import gpu_hopper

        if gpu_hopper.applies(p, vec):  # sm_90: the wgmma kernel (its autotuned tile when CUFLASH_TUNE asks)
            from .tune import pick_hopper_forward_tile

            gpu_hopper.forward(p, q4, k4, v4, o4, lse3, tile=pick_hopper_forward_tile(p))
            return
    if tile is None and vec:  # autotuned winner when CUFLASH_TUNE asks for it, else the table
        from .tune import pick_forward_tile

        tile = pick_forward_tile(p)
    spec, tile = forward_spec(p.dtype, p.d, p.causal is not None, vec, tile)
    launch_forward(spec, tile.block_m, p, q4, k4, v4, o4, lse3)


def launch_forward(spec, block_m, p, q4, k4, v4, o4, lse3):
    """One launch per chunk of at most 65535 batch entries; grid (query tiles, heads, batch)."""
    fn = get_function(spec)
    off = p.causal_offset if p.causal is not None else 0
    scale_log2 = np.float32(p.scale * _LOG2E)
    m_blocks = -(-p.nq // block_m)
    for b0 in range(0, p.batch, _MAX_GRID_Z):
        b1 = min(p.batch, b0 + _MAX_GRID_Z)
        qs, ks, vs, os_ = (a[b0:b1] for a in (q4, k4, v4, o4))
        ls = lse3[b0:b1]
        strides = []
        for a in (qs, ks, vs, os_):
            sb, sh, sn, _ = _elem_strides(a)
            strides += [np.int64(sb), np.int64(sh), np.int64(sn)]
        args = (qs, ks, vs, os_, ls, *strides, np.int32(p.nq), np.int32(p.nk), np.int32(p.d),
                np.int32(p.group), np.int32(off), scale_log2)
        fn((m_blocks, p.hq, b1 - b0), (spec.threads,), args, shared_mem=spec.smem_bytes)


def backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False):
    from . import gpu_backward

    gpu_backward.backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, deterministic=deterministic)
