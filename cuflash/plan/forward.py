"""Forward plans of the portable kernels (cuda_src/attn_fwd.cu: mma.sync, every GPU from sm_80):
the instantiation a tile and the run-time choices name."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.arrays import BFLOAT16, FLOAT16, FLOAT32, KERNEL_TYPE
from . import schedule
from .fp32 import all_forward_specs_fp32, forward_spec_fp32
from .spec import KernelSpec
from .spec import cpp_bool as _b

def forward_spec(dtype, d: int, causal: bool, vec: bool, tile=None, band: bool = False, target=None,
                 mods: bool = False, o32: bool = False):
    """(KernelSpec, TileConfig) of the forward kernel for these runtime choices.

    ``band``: the sliding-window / packed-sequence kernel attn_fwd_band (16-bit only; ``causal``
    is then ignored, the bounds are run-time arguments). The compile check instantiates exactly
    these, so what CI compiles is what runs. ``target``: the float32 kernels' default tile is the
    target's (plan.fp32.mma_runs). ``mods``: the band kernel with score modifiers,
    attn_fwd_band_mod (softcap, ALiBi, sinks; 16-byte loads only: MODS_NEED_VEC).
    ``o32``: attn_fwd_o32, the plain kernel storing a float32 o (16-bit inputs, vec operands;
    attention(out_dtype=float32))."""
    dtype = np.dtype(dtype)
    if mods and (dtype == FLOAT32 or not vec):
        raise NotImplementedError(MODS_FP32 if dtype == FLOAT32 else MODS_NEED_VEC)
    if dtype == FLOAT32:
        if band:
            raise NotImplementedError(FP32_BAND)
        return forward_spec_fp32(d, causal, vec, tile, target)
    hd, t = schedule.forward_tile(d, vec)
    if band and tile is None and hd in _BAND_BLOCK_N:
        t = dataclasses.replace(t, block_n=_BAND_BLOCK_N[hd], reason=f"band kernel: {_BAND_BLOCK_N[hd]}-key tiles")
    t = tile or t
    head = f"{KERNEL_TYPE[dtype]}, {hd}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}"
    if band or mods:
        expr = f"attn_fwd_band{'_mod' if mods else ''}<{head}, {_b(vec)}, {_b(t.lazy_rescale)}>"
    elif o32:
        if not vec:
            raise ValueError("o32: the float32 epilogue is instantiated for vec operands only")
        expr = f"attn_fwd_o32<{head}, {_b(causal)}, true" + ("" if t.lazy_rescale else ", false") + ">"
    else:
        expr = f"attn_fwd<{head}, {_b(causal)}, {_b(vec)}" + ("" if t.lazy_rescale else ", false") + ">"
    return KernelSpec("attn_fwd.cu", expr, t.threads, t.smem_bytes(hd)), t


# The band kernel keeps its bounds and sequence lengths in registers (the plain kernels read nk and
# the causal offset from kernel parameters): at d = 192 the table's 64-key tile then spills
# (255 registers + 32 bytes), the 32-key tile fits (239).
_BAND_BLOCK_N = {192: 32}


FP32_BAND = ("cuflash: window= and cu_seqlens_q= / cu_seqlens_k= are not implemented for float32 GPU inputs "
              "(float16/bfloat16 run them on the GPU; NumPy inputs run the CPU backend)")


MODS_FP32 = ("cuflash: softcap=, alibi_slopes= and sinks= are not implemented for float32 GPU inputs "
             "(float16/bfloat16 run them on the GPU; NumPy inputs run the CPU backend)")
MODS_NEED_VEC = ("cuflash: softcap=, alibi_slopes= and sinks= on the GPU need 16-byte loads: a head dim that is a "
                 "multiple of 8 and 16-byte aligned rows and strides (the NumPy backend takes any)")


def all_forward_specs():
    """Every forward instantiation the package can launch: what CI compiles for sm_90a."""
    specs = all_forward_specs_fp32()
    for dtype in (FLOAT16, BFLOAT16):
        for hd in schedule.HEAD_DIM_BUCKETS:
            for causal in (False, True):
                for vec in (False, True):
                    specs.append(forward_spec(dtype, hd, causal, vec)[0])
            for vec in (False, True):
                specs.append(forward_spec(dtype, hd, True, vec, band=True)[0])
            specs.append(forward_spec(dtype, hd, True, True, band=True, mods=True)[0])
            for causal in (False, True):  # out_dtype=float32 (vec operands)
                specs.append(forward_spec(dtype, hd, causal, True, o32=True)[0])
    return list(dict.fromkeys(specs))
