"""CUDA backend: a validated problem's arrays -> plan.dispatch's plan -> cuflash.kernels' launches,
on CuPy's current stream. Outputs are written in place (o4 (B, Hq, Nq, d), lse3 (B, Hq, Nq) float32;
the gradients dq4, dk4, dv4).

The ``tile`` / ``hopper_tile`` / ``split`` / ``persistent_blocks`` arguments force a plan (tests,
the schedule search and the tuner); without them the dispatch decides."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.arrays import FLOAT32
from ..plan import dispatch
from ..plan.forward import FP32_BAND, MODS_FP32, forward_spec
from ..kernels import backward as backward_kernels
from ..kernels import decode as decode_kernels
from ..kernels import decode_mla as mla_kernels
from ..kernels import device, fp32, hopper, tma
from ..kernels import fp8_forward as fp8_kernels
from ..kernels import forward as forward_kernels
from ..kernels import merge as merge_kernels
from ..kernels import packed_offsets
from ..kernels.operands import describe, unit_d, vector_ok, vector_ok_bytes


def _check_out(o4, p):
    if o4.strides[-1] != o4.itemsize and p.d > 1:
        raise ValueError("out: the head dim must have unit stride")


_BITS = {2: np.uint16, 4: np.uint32}


def _to_width(a, w, copy=False):
    """a with its last axis zero-padded to w, contiguous (a itself when already w wide, unless
    ``copy``); through the bits, as CuPy stores bfloat16 only."""
    import cupy

    if a.shape[-1] == w and not copy:
        return a
    c = cupy.zeros(a.shape[:-1] + (w,), dtype=a.dtype)
    bits = _BITS[a.dtype.itemsize]
    c.view(bits)[..., : a.shape[-1]] = a.view(bits)
    return c


def _from_width(dst, src):
    """dst[...] = src's first dst.shape[-1] columns (a no-op when src is dst)."""
    if src is not dst:
        bits = _BITS[dst.dtype.itemsize]
        dst.view(bits)[...] = src.view(bits)[..., : dst.shape[-1]]


def _padded_copies(p, arrays):
    """(p with d rounded up to a multiple of 8, zero-padded contiguous copies of the 16-bit
    arrays): the score-modifier kernels load 16 bytes at a time. Zero columns change no score,
    no D and no output column that is kept."""
    d8 = -(-p.d // 8) * 8
    return dataclasses.replace(p, d=d8), [_to_width(a, d8, copy=True) for a in arrays]


def _one_width(p):
    """dv != d (v and o narrower or wider than q and k) where no kernel takes dv natively (the
    backward; the forward outside plan.dispatch.head_dim_v_plan): the problem at w = max(d, dv) for
    both, the narrower side zero-padded by the callers. Zero columns of q and k change no score
    (the scale stays the one of the true d), zero columns of v give zero columns of o, and zero
    columns of o and do change no D = rowsum(do * o): the kept columns are exact. The padding costs
    a copy of the narrower operands and the padded columns' FLOPs."""
    return dispatch.one_width(p)


def decode_applies(p, k4, v4) -> bool:
    """Whether split-KV decode runs this problem (plan.dispatch.decode_applies on these K, V; MLA's
    (576, 512) always: its launcher copies rows it cannot read in place)."""
    if dispatch.mla_decode_applies(p):
        return True
    return dispatch.decode_applies(p, vector_ok((k4, v4), p.d))


def decode_applies_e4m3(p, k4, v4) -> bool:
    """Whether split-KV decode runs this problem with an e4m3 K/V cache (k4, v4 float8_e4m3fn:
    16-byte copies of d-byte rows, head dims of plan.schedule.DECODE_TILES_KV8)."""
    return dispatch.decode_applies_e4m3(p, vector_ok_bytes((k4, v4), p.d))


def decode(p, q4, k4, v4, o4, lse3, **options):
    """Split-KV decode (the caller checked decode_applies); options as kernels.decode.forward.
    MLA's (576, 512) head dims: attn_decode_mla (kernels.decode_mla.forward: kv_lens, paged, splits)."""
    if dispatch.mla_decode_applies(p):
        mla_kernels.forward(p, q4, k4, v4, o4, lse3, **options)
        return
    decode_kernels.forward(p, q4, k4, v4, o4, lse3, **options)


def forward(p, q4, k4, v4, o4, lse3, *, tile=None):
    """The forward of a validated problem. ``tile``: the portable kernel's TileConfig (or a
    float32 tile), which skips the decode and Hopper kernels."""
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    if dispatch.mla_decode_applies(p):  # (576, 512): validation admits it in decode shapes only
        if tile is not None:
            raise ValueError("tile: MLA decode (head dims 576 / 512) runs attn_decode_mla only")
        mla_kernels.forward(p, q4, k4, v4, o4, lse3)
        return
    if p.dv != p.d:
        if tile is None and _forward_dv(p, q4, k4, v4, o4, lse3):
            return
        pw = _one_width(p)
        ow = _to_width(o4, pw.d)
        forward(pw, *(_to_width(a, pw.d) for a in (q4, k4, v4)), ow, lse3, tile=tile)
        _from_width(o4, ow)
        return
    qu, ku, vu = unit_d(q4), unit_d(k4), unit_d(v4)
    if tile is None and decode_applies(p, ku, vu):  # few query rows per K/V head, long cache: split-KV
        decode_kernels.forward(p, qu, ku, vu, o4, lse3)
        return
    target = device.current()
    mod_wgmma = None
    # (rows without 16-byte loads take forward_band, which pads them first)
    if (p.modified and p.window is None and tile is None and np.dtype(p.dtype) != FLOAT32
            and vector_ok((qu, ku, vu, o4), p.d)):
        mod_wgmma = dispatch.forward_plan(p, target, describe(p.d, qu, ku, vu, o4, maps=target.hopper))
    if p.window is not None or (p.modified and (mod_wgmma is None or mod_wgmma.kernel != "wgmma_mod")):  # band kernels
        forward_band(p, q4, k4, v4, o4, lse3, tile=tile)
        return
    _check_out(o4, p)
    plan = mod_wgmma or dispatch.forward_plan(p, target, describe(p.d, qu, ku, vu, o4, maps=target.hopper), tile=tile)
    _launch_forward(plan, p, qu, ku, vu, o4, lse3)


def _forward_dv(p, q4, k4, v4, o4, lse3, *, tile=None) -> bool:
    """dv != d on the dv kernel (plan.dispatch.head_dim_v_plan), q and k d wide and v and o dv wide
    as they are: True once launched, False (nothing launched) where the dispatch pads instead."""
    if p.nk == 0 or o4.strides[-1] != o4.itemsize:
        return False  # (no key: a map cannot describe empty k, v; the padded path writes o = 0)
    target = device.current()
    qu, ku, vu = unit_d(q4), unit_d(k4), unit_d(v4)
    ops = describe(p.d, qu, ku, vu, o4, maps=target.hopper)
    plan = dispatch.head_dim_v_plan(p, target, ops, tile=tile)
    if plan is None:
        return False
    hopper.launch(plan, p, qu, ku, vu, o4, lse3)
    return True


def forward_o32(p, q4, k4, v4, o4, lse3) -> bool:
    """out_dtype=float32 of 16-bit inputs: the mma.sync kernel with a float32 epilogue
    (attn_fwd_o32) writes o4 (float32). False, launching nothing, where it does not apply
    (operands not 16-byte aligned with d a multiple of 8, a window or score modifiers); the caller
    then widens."""
    if p.window is not None or p.modified:
        return False
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return True
    qu, ku, vu = unit_d(q4), unit_d(k4), unit_d(v4)
    if o4.strides[-1] != o4.itemsize or not vector_ok((qu, ku, vu, o4), p.d):
        return False
    spec, t = forward_spec(p.dtype, p.d, p.causal is not None, True, o32=True)
    forward_kernels.launch_forward(spec, t.block_m, p, qu, ku, vu, o4, lse3)
    return True


def forward_wgmma(p, q4, k4, v4, o4, lse3, *, tile=None, persistent_blocks=None, split=None):
    """The wgmma forward on a forced tile and/or key split (plan.dispatch.wgmma_forward_plan; the
    caller checked plan.hopper.applies). dv != d: the dv kernel on ``tile`` (or its table's;
    ValueError where plan.dispatch.head_dim_v_plan does not take the problem)."""
    if p.modified:
        raise NotImplementedError("softcap=, alibi_slopes=, sinks=: the wgmma forward does not take score "
                                  "modifiers yet (cuflash.attention runs them on the mma.sync band kernel)")
    if p.dv != p.d:
        if persistent_blocks is not None or split is not None or not _forward_dv(p, q4, k4, v4, o4, lse3, tile=tile):
            raise ValueError(f"v's head dim {p.dv} unlike q's {p.d}: the dv kernel (no persistent_blocks or split) "
                             "does not run this problem here")
        return
    target = device.current()
    ops = describe(p.d, q4, k4, v4, o4, maps=True)
    plan = dispatch.wgmma_forward_plan(p, target, ops, tile=tile, split=split)
    hopper.launch(plan, p, q4, k4, v4, o4, lse3, persistent_blocks=persistent_blocks)


def forward_band(p, q4, k4, v4, o4, lse3, *, cu_seqlens=None, max_seqlen_q=None, tile=None):
    """Sliding window and/or packed sequences (plan.dispatch.band_forward_plan); packed:
    ``cu_seqlens=(cu_q, cu_k)`` and ``max_seqlen_q`` as kernels.forward.launch_band takes them."""
    if np.dtype(p.dtype) == FLOAT32:
        raise NotImplementedError(MODS_FP32 if p.modified else FP32_BAND)
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    if p.dv != p.d:
        pw = _one_width(p)
        ow = _to_width(o4, pw.d)
        forward_band(pw, *(_to_width(a, pw.d) for a in (q4, k4, v4)), ow, lse3, cu_seqlens=cu_seqlens,
                     max_seqlen_q=max_seqlen_q, tile=tile)
        _from_width(o4, ow)
        return
    if p.modified and not vector_ok((q4, k4, v4, o4), p.d):  # the modifier kernels load 16 bytes at a time
        import cupy

        pp, (qp, kp, vp) = _padded_copies(p, (q4, k4, v4))
        op = cupy.empty(qp.shape, dtype=p.dtype)
        forward_band(pp, qp, kp, vp, op, lse3, cu_seqlens=cu_seqlens, max_seqlen_q=max_seqlen_q, tile=tile)
        _from_width(o4, op)
        return
    q4, k4, v4 = unit_d(q4), unit_d(k4), unit_d(v4)
    _check_out(o4, p)
    ops = dispatch.Operands(vec=vector_ok((q4, k4, v4, o4), p.d))
    plan = dispatch.band_forward_plan(p, device.current(), ops, tile=tile)
    forward_kernels.launch_band(plan, p, q4, k4, v4, o4, lse3, cu_seqlens=cu_seqlens, max_seqlen_q=max_seqlen_q)


def forward_fp8(p, q4, k4, v4, o4, lse3, descales, *, cu_seqlens=None, max_seqlen_q=None, tile=None,
                persistent_blocks=None):
    """float8_e4m3fn q4, k4, v4 (uint8 bits; p.dtype e4m3) into o4 (bfloat16 or float16) and lse3 on
    the e4m3 kernel (plan.dispatch.fp8_forward_plan): no mask or a causal one, a window (p.window)
    or packed sequences (``cu_seqlens=(cu_q, cu_k)`` and ``max_seqlen_q`` as kernels.fp8_forward.launch
    takes them: (1, H, total, d) views, per-tensor descales). vt built per call, q and k copied only
    where TMA cannot address them, o through a scratch array where its rows are not whole 16-byte
    chunks. ``descales``: (q, k, v), each None or checked (core.fp8_inputs). ``tile`` forces a
    tile, ``persistent_blocks`` a persistent one's block count (tests)."""
    if p.nq == 0 or p.batch == 0 or p.hq == 0:
        return
    plan = dispatch.fp8_forward_plan(p, device.current(), o4.dtype, packed=cu_seqlens is not None, tile=tile)
    if p.nk == 0:  # no key: o = 0, lse = -inf (a map cannot describe an empty vt)
        o4.view(_BITS[o4.itemsize]).fill(0)
        lse3.fill(-np.inf)
        return
    if not tma.available():
        raise NotImplementedError("float8_e4m3fn GPU inputs need cuda-bindings: the e4m3 kernel reads them through "
                                  "tensor maps")
    q4, k4, v4 = (a if a.dtype == np.uint8 else a.view(np.uint8) for a in (q4, k4, v4))  # (the bits TMA copies)
    qu, ku = (fp8_kernels.tma_input(unit_d(a)) for a in (q4, k4))
    _check_out(o4, p)
    packed = dict(cu_seqlens=cu_seqlens, max_seqlen_q=max_seqlen_q, persistent_blocks=persistent_blocks)
    if vector_ok((o4,), p.d):
        fp8_kernels.launch(plan, p, qu, ku, unit_d(v4), o4, lse3, descales, **packed)
        return
    ow = _to_width(o4, -(-p.d // 8) * 8, copy=True)  # the epilogue stores whole 16-byte chunks
    fp8_kernels.launch(plan, p, qu, ku, unit_d(v4), ow, lse3, descales, **packed)
    _from_width(o4, ow)


def _launch_forward(plan, p, q4, k4, v4, o4, lse3):
    if plan.kernel in ("wgmma", "wgmma_split", "wgmma_mod"):
        hopper.launch(plan, p, q4, k4, v4, o4, lse3)
    else:
        forward_kernels.launch_forward(plan.spec, plan.block_m, p, q4, k4, v4, o4, lse3)


def backward(p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, *, deterministic=False, tile=None, hopper_tile=None,
             cu_seqlens=None, max_seqlens=None, dsinks=None):
    """The gradients of a validated problem into dq4, dk4, dv4. A window (p.window) or packed
    sequences (``cu_seqlens=(cu_q, cu_k)`` device int32 offsets, ``max_seqlens=(longest q,
    longest k)`` host ints; the arrays are (1, H, total, d) views of the packed ones) run the band
    kernels. ``tile`` / ``hopper_tile``: forced tiles (plan.dispatch.backward_plan). ``dsinks``:
    with sinks, a float32 (Hq,) device array that receives this problem's dsinks added in."""
    packed = cu_seqlens is not None
    if packed and max_seqlens is None:
        raise ValueError("max_seqlens: required with cu_seqlens (the grids cover the longest sequences)")
    if p.dv != p.d:
        pw = _one_width(p)
        grads = [_to_width(g, pw.d) for g in (dq4, dk4, dv4)]
        backward(pw, *(_to_width(a, pw.d) for a in (do4, q4, k4, v4, o4)), lse3, *grads,
                 deterministic=deterministic, tile=tile, hopper_tile=hopper_tile, cu_seqlens=cu_seqlens,
                 max_seqlens=max_seqlens, dsinks=dsinks)
        for g, gw in zip((dq4, dk4, dv4), grads):
            _from_width(g, gw)
        return
    target = device.current()
    if np.dtype(p.dtype) == FLOAT32 and p.modified:
        raise NotImplementedError(MODS_FP32)
    if np.dtype(p.dtype) == FLOAT32:  # float64 arithmetic on the FMA pipes or float64 tensor cores
        plan = dispatch.backward_plan(p, target, dispatch.Operands(vec=False), deterministic=deterministic,
                                      packed=packed, tile=tile, hopper_tile=hopper_tile)
        fp32.launch_backward(plan, p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4)
        return
    if p.batch == 0 or p.hq == 0:
        return
    if p.scores_modified and not vector_ok((do4, q4, k4, v4, o4, dq4, dk4, dv4), p.d):
        import cupy

        pp, padded = _padded_copies(p, (do4, q4, k4, v4, o4))
        grads = [cupy.empty(g.shape[:-1] + (pp.d,), dtype=p.dtype) for g in (dq4, dk4, dv4)]
        backward(pp, *padded, lse3, *grads, deterministic=deterministic, tile=tile, hopper_tile=hopper_tile,
                 cu_seqlens=cu_seqlens, max_seqlens=max_seqlens, dsinks=dsinks)
        for g, gp in zip((dq4, dk4, dv4), grads):
            _from_width(g, gp)
        return
    do4, q4, k4, v4, o4 = (unit_d(a) for a in (do4, q4, k4, v4, o4))
    ops = describe(p.d, q4, k4, v4, o4, do4, grads=(dq4, dk4, dv4), maps=target.hopper)
    plan = dispatch.backward_plan(p, target, ops, deterministic=deterministic, packed=packed, tile=tile,
                                  hopper_tile=hopper_tile)
    band = plan.kernel == "band"  # (softcap / ALiBi may run the wgmma K/V kernel with them)
    backward_kernels.launch(plan, p, do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4, deterministic=deterministic, band=band,
                            cu_seqlens=cu_seqlens, max_seqlens=max_seqlens, dsinks=dsinks)


def clamp_packed_offsets(cu_q, cu_k, total_q: int, total_k: int):
    """Device copies of unread packed offsets, every sequence inside the packed arrays
    (kernels.packed_offsets.clamp)."""
    return packed_offsets.clamp(cu_q, cu_k, total_q, total_k)


def merge(o5, lse4, out4, lse_out3):
    """Log-sum-exp merge of partial results (cuda_src/merge.cu): o5 (P, B, H, N, d), lse4
    (P, B, H, N) float32 -> out4 (B, H, N, d), lse_out3 (B, H, N) float32; any strides."""
    merge_kernels.launch(o5, lse4, out4, lse_out3)
