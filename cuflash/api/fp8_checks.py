"""The checks of cuflash.attention's FP8 (e4m3) calls that prepared calls share, and an e4m3 K/V
cache's descales in the form the split-KV decode kernel reads them.

``cuflash.attention`` (cuflash.api.functional) runs these checks on every uncached call;
``cuflash.prepare_attention`` and the plan cache (cuflash.api.prepared, cuflash.api.plan_cache) run
the same ones once per geometry, so that a prepared call raises what the uncached call raises.
"""

from __future__ import annotations

import functools

import numpy as np

from ..core import fp8_inputs
from ..core import problem as _problem
from ..core.arrays import FLOAT32, dtype_name

# The options an FP8 KV cache on the GPU does not take (the split-KV decode kernel has no _kv8 form of them).
GPU_CACHE_REFUSES = ("cu_seqlens_q", "cu_seqlens_k", "softcap", "alibi_slopes", "sinks")


@functools.lru_cache(maxsize=None)
def device_scalar(device, dtype, value):
    """A one-element CuPy array of `value` on `device`, made once: a decode call's stand-ins and unit
    descales cost no allocation and no fill launch per call (never written). (zeros first: CuPy
    stores bfloat16 without casts, and a stand-in's value is 0.)"""
    import cupy

    with cupy.cuda.Device(device):
        a = cupy.zeros((1,), dtype=dtype)
        if value:
            a.fill(value)
    return a


def unit_descale(device):
    """The float32 1 an FP8 KV cache's missing descale stands for, a 0-d CuPy array on `device`
    (one per device, kept: a prepared call keeps its address)."""
    return device_scalar(device, FLOAT32, 1).reshape(())


def check_host(arrays, descales, out_dtype, layout, dense):
    """An FP8 call of NumPy arrays checked as the NumPy backend takes it: (o's dtype, the three
    descales as float32 NumPy arrays, None for an FP8 KV cache's 16-bit q). ``dense``: no packed
    sequences or paged cache (descales per batch entry and head allowed). TypeError / ValueError
    naming the argument."""
    odt = fp8_inputs.check_call(arrays, descales, out_dtype)
    _problem.check_layout(layout)
    return odt, fp8_inputs.checked_descales(arrays, descales, layout, dense)


def check_gpu_cache(q, k, v, descales, out_dtype, options):
    """A 16-bit GPU q with an e4m3 K/V cache (CuPy arrays; e4m3 as float8_e4m3fn or uint8 bits),
    checked as the split-KV decode kernel takes it, before out= and the values of kv_lens /
    block_table: (problem, block size or None, k_descale, v_descale), the descales checked float32
    CuPy arrays or None (1). The shapes are validated as a 16-bit call's, on stand-ins of k and v in
    q's dtype that hold no memory. ``options``: causal, scale, layout, window, block_table, and
    any of GPU_CACHE_REFUSES (absent: not given). TypeError / ValueError / NotImplementedError
    naming the argument."""
    import cupy

    if descales[0] is not None:
        raise TypeError(f"q_descale: a {dtype_name(q.dtype)} q takes no descale (k and v are the FP8 cache)")
    for name, a in (("k", k), ("v", v)):
        if not fp8_inputs.holds_e4m3(a):
            raise TypeError(f"{name}: expected the e4m3 bits of an FP8 KV cache (uint8, or float8_e4m3fn) like "
                            f"{'v' if name == 'k' else 'k'}, got {dtype_name(a.dtype)}")
    unsupported = [n for n in GPU_CACHE_REFUSES if options.get(n) is not None]
    if unsupported:
        raise NotImplementedError(f"{', '.join(unsupported)}: an FP8 KV cache on the GPU runs the split-KV decode "
                                  "kernel, which does not take them")
    if out_dtype is not None and np.dtype(out_dtype) != q.dtype:
        raise NotImplementedError(f"out_dtype: an FP8 KV cache on the GPU gives o in q's dtype "
                                  f"({dtype_name(q.dtype)}), not {out_dtype!r}")
    zero = device_scalar(cupy.cuda.Device().id, q.dtype, 0)
    stand_ins = [cupy.lib.stride_tricks.as_strided(zero, a.shape, (0,) * a.ndim) for a in (k, v)]
    shape_opts = dict(causal=options["causal"], scale=options["scale"], layout=options["layout"],
                      window=options["window"])
    block_table = options["block_table"]
    if block_table is not None:
        p, bs = _problem.validate_paged(q, *stand_ins, block_table, **shape_opts)
    else:
        p, bs = _problem.validate_forward(q, *stand_ins, **shape_opts), None
    if p.dv != p.d:
        raise NotImplementedError("v: an FP8 KV cache on the GPU takes v with k's head dim")
    _, kd, vd = fp8_inputs.checked_gpu_descales((q, k, v), descales, options["layout"], cupy)
    if block_table is not None:
        for name, x in (("k_descale", kd), ("v_descale", vd)):
            if x is not None and x.size != 1:
                raise ValueError(f"{name}: a paged cache takes one factor per tensor, got shape {tuple(x.shape)}")
    return p, bs, kd, vd


def descale_operands(k_descale, v_descale, batch, hkv, device):
    """(k descales, v descales, batch stride, head stride): an e4m3 cache's checked descales
    (check_gpu_cache) as attn_decode_kv8 reads them (kernels.decode.forward's kv_descales), the
    factor of sequence b, K/V head h at index b * batch stride + h * head stride. None stands for 1
    (unit_descale). Both per tensor: themselves, strides 0. Otherwise both as (batch, hkv) float32 in
    C order, strides (hkv, 1): a per-head descale already stored so (C-contiguous) is read in place,
    anything else (a per-tensor factor beside a per-head one, other strides) is copied into that
    form (an allocation and a copy kernel on the current stream)."""
    import cupy

    one = unit_descale(device)
    kd, vd = (one if x is None else x for x in (k_descale, v_descale))
    if kd.size == 1 and vd.size == 1:
        return kd.reshape(()), vd.reshape(()), 0, 0

    def rows(x):
        if x.size > 1 and x.flags.c_contiguous:  # (batch..., Hkv) in C order: (b, h) at b * hkv + h
            return x
        return cupy.ascontiguousarray(cupy.broadcast_to(x.reshape(-1, hkv) if x.size > 1 else x.reshape(1, 1),
                                                        (batch, hkv)))

    return rows(kd), rows(vd), hkv, 1
