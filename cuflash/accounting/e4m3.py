"""Accounting of the float8_e4m3fn forward (kernels.fp8_forward): its device buffers and its HBM
traffic, vt's build and the copies the call makes included."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..core import masks
from ..core.arrays import BFLOAT16, FLOAT16, FLOAT32, dtype_name
from ..core.fp8_inputs import E4M3
from ..plan import dispatch, schedule
from ..plan.hopper import FP8_VT_COLS, FP8_VT_KEYS, FP8_VT_SMEM_BYTES, VT_GROUP, vt_keys
from ..plan.schedule import vt_slot_keys
from .arguments import as_shape_and_dtype, check_dtype, check_int, check_shape, int_list, problem_dims
from .launches import H200_SMEM_PER_SM_BYTES, MODEL
from .pairs import sequence_lengths
from .reports import (INPUT, INTERMEDIATE, LSE_ITEMSIZE, ON_CHIP, OUTPUT, SAVED, WORKSPACE, IOEntry, IOModel, MemoryEntry,
                      MemoryReport)
from .tile_walk import paper_bound, visible_key_tiles


E4M3_OUT_DTYPES = (BFLOAT16, FLOAT16)  # what the e4m3 kernel stores (core.fp8_inputs.check_gpu_call)
DESCALES = ("q_descale", "k_descale", "v_descale")


def _e4m3_view(shape, layout, packed):
    """(B, H, N, d) extents and (B, H, N) byte strides of the view the e4m3 launch takes of a
    contiguous e4m3 input of ``shape`` (core.layout.to_bhsd; packed (total, H, d): (1, H, total, d))."""
    if packed:
        n, h, d = shape
        return (1, h, n, d), (n * h * d, d, h * d)
    if len(shape) == 2:
        n, d = shape
        return (1, 1, n, d), (n * d, n * d, d)
    b = math.prod(shape[:-3])
    if layout == "bhsd":
        h, n, d = shape[-3:]
        return (b, h, n, d), (h * n * d, n * d, d)
    n, h, d = shape[-3:]
    return (b, h, n, d), (n * h * d, d, h * d)


def _e4m3_tma_copy(extents, strides) -> bool:
    """Whether kernels.fp8_forward.tma_input copies this view (d zero-padded to a multiple of 16):
    a byte stride of an axis of extent > 1 is no multiple of 16 (kernels.tma.bhsd_strides gives an
    axis of extent 1 a nominal one; the pool's arrays are 16-byte aligned)."""
    return any(n > 1 and s % 16 for n, s in zip(extents[:3], strides))


def _e4m3_out_dtype(out_dtype, method):
    """o's dtype of an e4m3 forward: the kernel's bfloat16 (default) or float16; the reference's
    bfloat16 (cuflash.backends.reference.attention). ValueError naming out_dtype otherwise."""
    if out_dtype is None:
        return BFLOAT16
    try:
        odt = check_dtype("out_dtype", out_dtype)
    except TypeError:
        odt = None
    allowed = E4M3_OUT_DTYPES if method == "tiled" else (BFLOAT16,)
    if odt not in allowed:
        why = ("the e4m3 kernel stores bfloat16 or float16 (float32 is not implemented for float8_e4m3fn GPU "
               "inputs)" if method == "tiled" else "the reference gives float8_e4m3fn inputs' o in bfloat16")
        raise ValueError(f"out_dtype: {why}; got {out_dtype!r}")
    return odt


def _e4m3_descales(descales, shapes, layout, hq, hkv, packed):
    """An input entry per given descale (an array or its shape), checked as cuflash.attention checks
    them (core.fp8_inputs): float32, shape () or (1,) or - dense inputs - the input's batch axes
    + (H,) (q also + (Hkv,) where Hkv < Hq; (1, 1) for a 2-D input). TypeError / ValueError naming it."""
    entries = []
    for name, x, shape in zip(DESCALES, descales, shapes):
        if x is None:
            continue
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            if np.dtype(x.dtype) != FLOAT32:
                raise TypeError(f"{name}: expected dtype float32, got {dtype_name(np.dtype(x.dtype))}")
            ds = tuple(int(n) for n in x.shape)
        else:
            ds = check_shape(name, x)
        wants = [(), (1,)]
        if not packed:
            if len(shape) == 2:
                wants.append((1, 1))
            else:
                heads = shape[-3] if layout == "bhsd" else shape[-2]
                wants.append(shape[:-3] + (heads,))
                if name == "q_descale" and hkv < hq:
                    wants.append(shape[:-3] + (hkv,))
        if ds not in wants:
            why = " (packed sequences take one factor per tensor)" if packed else ""
            raise ValueError(f"{name}: expected shape {' or '.join(str(w) for w in wants)}{why}, got {ds}")
        what = "per tensor" if math.prod(ds) == 1 and len(ds) < 2 else "per batch entry and head"
        entries.append(MemoryEntry(name, INPUT, math.prod(ds) * 4, f"float32 {ds}, {what}"))
    return entries


def memory_report_e4m3(q, k, v, *, method, pass_, causal, window, layout, out_dtype, descales, cu_seqlens_q,
                        cu_seqlens_k, registers, refused, unread_offsets=False) -> MemoryReport:
    """memory_report of float8_e4m3fn q, k, v: the e4m3 forward (kernels.fp8_forward) or the
    reference's dequantized formula (backends.reference.attention)."""
    if pass_ != "fwd":
        raise ValueError(f"pass_: float8_e4m3fn inputs have a forward only (no e4m3 backward), got {pass_!r}")
    for name, value in refused.items():
        if value is not None:
            raise ValueError(f"{name}: not taken by the float8_e4m3fn forward (cuflash.attention refuses it "
                             "or has no such launch)")
    odt = _e4m3_out_dtype(out_dtype, method)
    window = masks.normalize_window(window)
    named = [("q", q), ("k", k), ("v", k if v is None else v)]
    shapes = [as_shape_and_dtype(n, x)[0] for n, x in named]
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    notes = []
    if packed:
        if method != "tiled":
            raise ValueError("cu_seqlens_q: packed sequences are modelled for method='tiled' (the e4m3 band kernel)")
        n_seq, hq, hkv, d, _ = sequence_lengths(shapes[0], shapes[1], "bshd", None, cu_seqlens_q, cu_seqlens_k)
        if len(shapes[2]) != 3 or shapes[2][:2] != shapes[1][:2]:
            raise ValueError(f"v: expected packed ({shapes[1][0]}, {hkv}, dv) like k, got {shapes[2]}")
        batch, nq, nk, dv = 1, shapes[0][0], shapes[1][0], shapes[2][2]
        offsets = len(int_list("cu_seqlens_q", cu_seqlens_q))
        notes.append(f"packed: {n_seq} sequences, Nq and Nk are the totals; one launch of the band kernel over "
                     "(1, H, total, d) views")
    else:
        p = problem_dims(q, k, v, layout, E4M3, bits=True)
        batch, hq, hkv, nq, nk, d, dv = p.batch, p.hq, p.hkv, p.nq, p.nk, p.d, p.dv
    if method == "tiled" and dv != d:
        raise ValueError(f"v: head dim {dv} unlike q's {d}: the e4m3 kernel takes one head dim")
    q_elems, k_elems, v_elems = batch * hq * nq * d, batch * hkv * nk * d, batch * hkv * nk * dv
    rows, o_elems = batch * hq * nq, batch * hq * nq * dv
    E = [MemoryEntry("Q", INPUT, q_elems, "e4m3, 1 byte: B*Hq*Nq*d"),
         MemoryEntry("K", INPUT, k_elems, "e4m3, 1 byte: B*Hkv*Nk*d"),
         MemoryEntry("V", INPUT, v_elems, "e4m3, 1 byte: B*Hkv*Nk*" + ("d" if dv == d else "dv"))]
    E += _e4m3_descales(descales, shapes, layout, hq, hkv, packed)
    if packed:
        E += [MemoryEntry(name, INPUT, offsets * 4, f"int32, {offsets} offsets")
              for name in ("cu_seqlens_q", "cu_seqlens_k")]
    E += [MemoryEntry("O", OUTPUT, o_elems * odt.itemsize, f"{dtype_name(odt)} B*Hq*Nq*" + ("d" if dv == d else "dv")),
          MemoryEntry("LSE", SAVED, rows * LSE_ITEMSIZE, "float32 log-sum-exp, B*Hq*Nq*4: written by the forward")]
    shape = dict(batch=batch, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d)
    if dv != d:
        shape["dv"] = dv
    if method == "reference":
        nn = batch * hq * nq * nk
        E += [MemoryEntry("Q (dequantized)", WORKSPACE, q_elems * 4, "float32 q8 * q_descale", phase="fwd"),
              MemoryEntry("K (dequantized)", WORKSPACE, k_elems * 4, "float32 k8 * k_descale", phase="fwd"),
              MemoryEntry("V (dequantized)", WORKSPACE, v_elems * 4, "float32 v8 * v_descale", phase="fwd"),
              MemoryEntry("O (float32)", WORKSPACE, o_elems * 4, "the float32 formula's o, rounded once to bfloat16",
                          phase="fwd"),
              MemoryEntry("S", INTERMEDIATE, nn * 4, "float32 scores B*Hq*Nq*Nk (all pairs; masked after)", phase="fwd"),
              MemoryEntry("P", INTERMEDIATE, nn * 4, "float32 probabilities B*Hq*Nq*Nk", phase="fwd", reuses="S")]
        notes.append("reference, float8_e4m3fn: NumPy arrays only (host memory); q, k, v dequantized to float32 "
                     "(through one float64 temporary pair per input, freed at once: not counted), then the float32 "
                     "formula (its own widening copies not counted, as for 16-bit inputs)")
        return MemoryReport(method, pass_, dtype_name(E4M3), shape, tuple(E), tuple(notes))
    hd = schedule.fp8_head_dim(d)
    plan = dispatch.fp8_forward_plan(SimpleNamespace(d=d, causal=causal, window=window), MODEL, odt, packed=packed)
    t, spec = plan.tile, plan.spec
    if nq and batch and hq and nk:  # (kernels run; backends.cuda.forward_fp8 allocates nothing otherwise)
        if packed and unread_offsets:
            E.append(MemoryEntry("offsets (clamped)", WORKSPACE, 2 * offsets * 4,
                                 f"int32 (2, {offsets}): cu_seqlens_q / _k clamped into the packed arrays on the "
                                 "device (offsets not read on the host)", phase="fwd"))
        E.append(MemoryEntry("vt", WORKSPACE, batch * hkv * d * vt_keys(nk),
                             f"uint8 (B, Hkv, d, Nk rounded up to {VT_GROUP} = {vt_keys(nk)}): V transposed by "
                             "fp8_pack_vt, built every call", phase="fwd"))
        d16 = -(-d // 16) * 16
        for name, heads, n, shp in (("Q", hq, nq, shapes[0]), ("K", hkv, nk, shapes[1])):
            if _e4m3_tma_copy(*_e4m3_view(shp, layout, packed)):
                E.append(MemoryEntry(f"{name} (zero-padded copy)", WORKSPACE, batch * heads * n * d16,
                                     f"uint8 (B, H, N, {d16}): rows TMA cannot address (byte strides no multiple "
                                     "of 16) copied with d zero-padded to a multiple of 16", phase="fwd"))
        if d % 8:
            d8 = -(-d // 8) * 8
            E.append(MemoryEntry("O (scratch)", WORKSPACE, rows * d8 * odt.itemsize,
                                 f"{dtype_name(odt)} (B, Hq, Nq, {d8}): the epilogue stores whole 16-byte chunks; "
                                 "copied into o", phase="fwd"))
    E.append(MemoryEntry("shared memory / block (fwd)", ON_CHIP, spec.smem_bytes,
                         f"{t.block_m} query rows x {t.block_n}-key tiles, head dim padded to {hd}; {spec.short_name}"))
    E.append(MemoryEntry("shared memory / block (vt)", ON_CHIP, FP8_VT_SMEM_BYTES,
                         f"fp8_pack_vt: {FP8_VT_KEYS} keys x {FP8_VT_COLS} columns, static"))
    if registers is not None:
        registers = check_int("registers", registers, minimum=1)
        E.append(MemoryEntry("registers / block (fwd)", ON_CHIP, registers * 4 * spec.threads,
                             f"{registers} registers/thread x {spec.threads} threads x 4 B"))
    notes.append("float8_e4m3fn: contiguous inputs; descales are read where they are (no copy)")
    return MemoryReport(method, pass_, dtype_name(E4M3), shape, tuple(E), tuple(notes))


def _vt_keys_read(n_tiles, bn, nk_pad):
    """Keys of vt that key tiles 0 .. n_tiles - 1 (of bn keys) load: each whole 128-key boxes from its
    first key (vt_slot_keys), none past vt's nk_pad keys (TMA reads nothing out of bounds)."""
    box = vt_slot_keys(bn)
    whole = 0 if nk_pad < box else min(n_tiles, (nk_pad - box) // bn + 1)  # tiles whose boxes end in vt
    rest = n_tiles - whole
    return whole * box + rest * nk_pad - bn * (whole + n_tiles - 1) * rest // 2


def io_model_e4m3(batch, hq, hkv, nq, nk, d, causal, pass_, config, kv_dtype, out_dtype, sram_bytes) -> IOModel:
    """io_model of float8_e4m3fn q, k, v: the e4m3 forward's call on contiguous (B, H, N, d) inputs
    (backends.cuda.forward_fp8): vt's build, the kernel's tiles, and the copies it makes."""
    if pass_ != "fwd":
        raise ValueError(f"pass_: float8_e4m3fn inputs have a forward only (no e4m3 backward), got {pass_!r}")
    if config is not None:
        raise ValueError("config: the e4m3 forward runs its table's tile (schedule.HOPPER_FP8_FORWARD_TILES)")
    if kv_dtype is not None:
        raise ValueError("kv_dtype: with dtype float8_e4m3fn q, k and v are all e4m3 (kv_dtype is for a 16-bit q "
                         "over an e4m3 cache)")
    odt = _e4m3_out_dtype(out_dtype, "tiled")
    os_ = odt.itemsize
    plan = dispatch.fp8_forward_plan(SimpleNamespace(d=d, causal=causal, window=None), MODEL, odt)
    t, spec = plan.tile, plan.spec
    bm, bn = t.block_m, t.block_n
    bh, bhkv = batch * hq, batch * hkv
    qe, kve, rows = bh * nq * d, bhkv * nk * d, bh * nq
    nk_pad = vt_keys(nk)
    k_keys = vt_cols = computed = 0  # keys of K and of vt each query tile loads (summed over one head's tiles)
    for row0 in range(0, nq, bm):
        row1 = min(nq, row0 + bm)
        n_tiles = visible_key_tiles(causal, nq, nk, row0, row1, bn)
        end = n_tiles * bn
        k_keys += min(nk, end)
        vt_cols += _vt_keys_read(n_tiles, bn, nk_pad)
        computed += (row1 - row0) * min(nk, end)
    runs = bool(nq and batch and hq and nk)  # backends.cuda.forward_fp8 launches nothing otherwise
    d16, d8 = -(-d // 16) * 16, -(-d // 8) * 8
    entries, assumptions = [], []
    widths = {}
    for name, heads, n in (("Q", hq, nq), ("K", hkv, nk)):
        copy = runs and _e4m3_tma_copy(*_e4m3_view((batch, heads, n, d), "bhsd", False))
        widths[name] = d16 if copy else d
        if copy:
            entries.append(IOEntry(f"{name} (zero-padded copy)", batch * heads * n * d, batch * heads * n * (d16 + d), 1,
                                   f"zeroed at {d16} columns, then its {d} columns copied in (rows TMA cannot address)"))
    if runs:
        entries += [
            IOEntry("Q", bh * nq * widths["Q"], 0, 1, "e4m3, read once" + (" (the copy)" if widths["Q"] != d else "")),
            IOEntry("K", bh * k_keys * widths["K"], 0, 1, f"e4m3, once per query tile ({bm} rows) per query head"
                    + (" (the copy)" if widths["K"] != d else "")),
            IOEntry("V (vt build)", kve, 0, 1, "e4m3, read once by fp8_pack_vt"),
            IOEntry("vt (build)", 0, bhkv * d * nk_pad, 1, f"written once: d rows of Nk rounded up to {VT_GROUP} "
                    f"= {nk_pad} keys (zeros past Nk)"),
            IOEntry("vt", bh * vt_cols * d, 0, 1, f"read instead of V: once per query tile per query head, keys up to "
                    f"{nk_pad}"),
        ]
    if runs and d % 8:
        entries += [IOEntry("O (scratch)", qe, 2 * bh * nq * d8, os_, f"zeroed and written by the kernel at {d8} "
                            "columns (whole 16-byte chunks), its d columns read to copy into o"),
                    IOEntry("O", 0, qe, os_, f"{dtype_name(odt)}, written once (the copy)")]
    elif runs:
        entries.append(IOEntry("O", 0, qe, os_, f"{dtype_name(odt)}, written once"))
    else:  # no key: o filled with zeros (and the LSE with -inf), no kernel
        entries.append(IOEntry("O", 0, qe, os_, f"{dtype_name(odt)}, zeros written once (no key)"))
    entries.append(IOEntry("LSE", 0, rows, LSE_ITEMSIZE, "float32, written once"))
    computed *= bh
    sram = H200_SMEM_PER_SM_BYTES if sram_bytes is None else check_int("sram_bytes", sram_bytes, minimum=1)
    M = sram  # elements of one byte
    assumptions.append(f"e4m3 forward tile {bm}x{bn} from {spec.short_name}; every query head rereads its K and vt "
                       "tiles (GQA heads share no loads)")
    assumptions.append("vt (V transposed, keys in groups of 32) is built by fp8_pack_vt on every call; the descales' "
                       "float32 factors (a few per block) are not counted; contiguous (B, H, N, d) inputs")
    if causal is not None:
        assumptions.append("causal: only K/V tiles with masks.tile_is_visible are loaded")
    reference = bh * (4 * nq * nk + 2 * (nq + nk) * d + nq)
    paper, standard = paper_bound(assumptions, bh, nq, nk, d, M, sram, 1, sram_bytes is None)
    compulsory = qe + 2 * kve + qe * os_ + rows * LSE_ITEMSIZE
    return IOModel(pass_, batch, hq, hkv, nq, nk, d, dtype_name(E4M3), causal, bm, bn, 0, 0, tuple(entries),
                   sram, M, paper, standard, reference, computed, 0, compulsory, tuple(assumptions))
