"""memory_report: every device buffer of one attention pass, exact bytes, by category."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from ..core import masks
from ..core.arrays import FLOAT32, dtype_name
from ..core.fp8_inputs import E4M3
from ..core.problem import MLA_HEAD_DIMS, check_flag, check_max_seqlens, check_out_dtype, is_mla, offsets_unread
from ..plan import decode_mla
from ..plan import forward as plan_forward
from ..plan import schedule
from .arguments import (METHODS, PASSES, as_shape_and_dtype, check_choice, check_config, check_head_dim, check_int,
                        input_dtype, int_list, problem_dims)
from .e4m3 import DESCALES, memory_report_e4m3
from .launches import (H200_SM_COUNT, backward_frag_dq, backward_launch, decode_launch, dq_accumulator_width, forward_dv_launch,
                       forward_key_split, forward_launch)
from .reports import (ACC_ITEMSIZE, INPUT, INTERMEDIATE, LSE_ITEMSIZE, ON_CHIP, OUTPUT, SAVED, WORKSPACE, MemoryEntry,
                      MemoryReport)


# The entries of a memory report sized by q's and k's head dim, and by v's.
_QK_WIDE = ("Q", "K", "dQ", "dK")
_V_WIDE = ("V", "O", "dO", "dV")


def _narrowed(wide: MemoryReport, d: int, dv: int, tiled: bool, native=None, registers=None) -> MemoryReport:
    """A report of the problem at width w = max(d, dv) for both head dims, as the one with v's head
    dim dv: Q, K, dQ, dK at d and V, O, dO, dV at dv; the GPU (``tiled``) also holds a zero-padded
    w-wide copy of each narrower one while a pass runs that takes one head dim
    (cuflash.backends.cuda._one_width). ``native``: the forward's launch where the dv kernel runs it
    (forward_launch with dv): no copies in the forward, its shared memory and threads, no key split."""
    w = max(d, dv)
    entries = []
    for e in wide.entries:
        if native is not None and e.phase == "fwd" and e.name.endswith("(key split)"):
            continue  # the dv kernel runs one piece per query tile
        if native is not None and e.name == "shared memory / block (fwd)":
            e = dataclasses.replace(e, bytes=native.smem, note=f"{native.block_m} query rows x {native.block_n}-key "
                                    f"tiles, head dims {native.hd} (q, k) and {native.hd_v} (v, o); {native.source}")
        if native is not None and e.name == "registers / block (fwd)":
            e = dataclasses.replace(e, bytes=registers * 4 * native.threads,
                                    note=f"{registers} registers/thread x {native.threads} threads x 4 B")
        true = d if e.name in _QK_WIDE else dv if e.name in _V_WIDE else w
        if true == w:
            entries.append(e)
            continue
        entries.append(dataclasses.replace(e, bytes=e.bytes // w * true, note=e.note.replace("*d", f"*{true}")))
        if tiled:
            fwd_copy = e.name in ("Q", "K", "V", "O") and wide.pass_ != "bwd"
            if not (fwd_copy and native is not None):
                entries.append(MemoryEntry(f"{e.name} (zero-padded copy)", WORKSPACE, e.bytes,
                                           f"{e.name} at head dim {w} for the kernels", phase="fwd" if fwd_copy else "bwd"))
            if e.name in ("Q", "K", "V", "O") and wide.pass_ == "fwd+bwd":
                again = "for the backward's kernels" if native is not None else "padded again by the backward"
                entries.append(MemoryEntry(f"{e.name} (zero-padded copy, bwd)", WORKSPACE, e.bytes,
                                           f"{e.name} at head dim {w}, {again}", phase="bwd"))
    shape = dict(wide.shape, d=d, dv=dv)
    notes = tuple(n for n in wide.notes if native is None or not n.startswith("the key split"))
    if not tiled:
        note = "no padding"
    elif native is None:
        note = f"the kernels run at {w} on zero-padded copies"
    else:
        note = (f"the forward's dv kernel reads and writes them as they are (no copy; P V over {dv} columns)"
                + (f"; the backward runs at {w} on zero-padded copies" if wide.pass_ != "fwd" else ""))
    return MemoryReport(wide.method, wide.pass_, wide.dtype, shape, tuple(entries),
                        notes + (f"v's head dim {dv} unlike q's {d}: " + note,))


def _offsets_unread(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate) -> bool:
    """Whether a GPU call with these arguments leaves the packed offsets unread on the host (both
    maxima, validate=False: cuflash.attention then clamps them on the device)."""
    check_flag("validate", validate)
    given = check_max_seqlens(max_seqlen_q, max_seqlen_k, packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    return offsets_unread(given, validate, on_device=True)


def memory_report(q, k, v=None, *, method="tiled", pass_="fwd", dtype=None, causal=False, config=None,
                  layout="bhsd", splits=None, registers=None, deterministic=False, alibi_slopes=None,
                  sinks=None, out_dtype=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, q_descale=None,
                  k_descale=None, v_descale=None, v_aliases_k=True, max_seqlen_q=None, max_seqlen_k=None,
                  validate=True) -> MemoryReport:
    """Every device buffer of one attention pass, exact bytes, by category.

    q, k, v are arrays (their shapes and dtype) or shapes; v defaults to k's shape. Without arrays
    or ``dtype`` the dtype is bfloat16. ``method="tiled"`` is cuflash's kernels; ``"reference"``
    materializes the float32 N x N scores S and probabilities P (and dP, dS in the backward), each
    listed, plus the in-place variant where P overwrites S and dS overwrites dP.

    Categories: inputs (Q, K, V; the backward also reads O and dO), outputs (O; dQ, dK, dV), saved
    state (the float32 log-sum-exp, B*Hq*Nq*4 bytes), workspace (the backward's float32 dQ
    accumulator, its rows padded to the head-dim bucket as allocated, and D = rowsum(dO * O);
    split-KV partial results when ``splits`` > 1 or the config has ``splits``; by default those the
    decode launch allocates, none when its splits merge inside a thread-block cluster), intermediates
    (reference only), and on-chip storage per thread block (shared memory of the launched kernels,
    see :func:`forward_launch` / :func:`backward_launch`; registers of the forward when
    ``registers`` per thread is given) which is not device memory and is never added to the
    totals. ``causal`` and ``deterministic`` change no device buffer.

    ``alibi_slopes`` / ``sinks``: arrays or shapes of the score modifiers' float32 inputs (listed
    as inputs; the backward with sinks also writes dsinks, float32 (Hq,)). A softcap adds no
    buffer.

    MLA decoding's head dims (q and k 576, v 512; decode shapes): attn_decode_mla's call
    (plan.decode_mla), the forward on the kernel only. ``v_aliases_k`` (default True, the MLA use):
    v is k[..., :512], a view of K's memory that adds no bytes; False: v is its own array. Workspace:
    the splits' float32 partial O (512 wide) and LSE where the plan (or ``splits``) splits the keys.

    ``out_dtype=float32`` (forward, tiled) with 16-bit inputs models ``attention(...,
    out_dtype=float32)`` on the GPU: for d a multiple of 8 the mma.sync kernel with a float32
    epilogue (a float32 O, nothing else); otherwise the inputs are widened to float32 copies
    (workspace) and the float32 kernels run.

    float8_e4m3fn q, k, v (``dtype="float8_e4m3fn"``, e4m3 arrays, or uint8 arrays of their bits
    with ``dtype`` or a descale given, as cuflash.attention takes them): the forward only
    (``pass_="fwd"``; there is no e4m3 backward). Tiled: the e4m3 kernel's call
    (backends.cuda.forward_fp8, contiguous inputs): inputs Q, K, V at 1 byte per element, the
    float32 ``q_descale`` / ``k_descale`` / ``v_descale`` given (arrays or shapes: () or (1,), or
    dense inputs' batch axes + (H,), q's also + (Hkv,)), with ``cu_seqlens_q`` / ``cu_seqlens_k``
    (packed (total, H, d) inputs, the band kernel) the int32 offsets; outputs O in ``out_dtype``
    (bfloat16 by default, or float16) and the float32 LSE; workspace vt, uint8
    B*Hkv*d*vt_keys(Nk) (Nk rounded up to 32, built every call), a zero-padded copy of Q and of K
    (B*H*N*ceil(d/16)*16 bytes) where their byte strides are no multiples of 16 (d % 16 != 0), and
    for d % 8 != 0 an O scratch of ceil(d/8)*8 columns; on chip the kernel's shared memory
    (``window``: the band kernel) and fp8_pack_vt's; packed with ``max_seqlen_q`` and
    ``max_seqlen_k`` and ``validate=False`` (offsets not read on the host) also the offsets'
    clamped device copies, int32 2*(B+1). Reference: the dequantized float32 Q, K, V,
    the float32 o rounded to bfloat16, and S, P (NumPy arrays only: host memory).
    """
    check_choice("method", method, METHODS)
    check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    descales = (q_descale, k_descale, v_descale)
    dt = input_dtype([("q", q), ("k", k), ("v", k if v is None else v)], dtype,
                      bits=any(x is not None for x in descales))
    if dt == E4M3:
        return memory_report_e4m3(q, k, v, method=method, pass_=pass_, causal=causal, window=window, layout=layout,
                                   out_dtype=out_dtype, descales=descales, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, registers=registers,
                                   unread_offsets=_offsets_unread(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k, validate),
                                   refused=dict(config=config, splits=splits, alibi_slopes=alibi_slopes, sinks=sinks))
    for name, x in zip(DESCALES, descales):
        if x is not None:
            raise TypeError(f"{name}: a descale goes with float8_e4m3fn inputs, not {dtype_name(dt)}")
    for name, x in (("window", window), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if x is not None:
            raise ValueError(f"{name}: modelled for float8_e4m3fn inputs only (the {dtype_name(dt)} report covers "
                             "dense inputs without a window)")
    p = problem_dims(q, k, v, layout, dtype)
    run = dict(method=method, pass_=pass_, causal=causal, config=config, layout=layout, splits=splits,
               registers=registers, deterministic=deterministic)
    if is_mla(p):
        return _report_mla(p, out_dtype, alibi_slopes, sinks, v_aliases_k, **run)
    if p.dv != p.d:
        return _report_head_dim_v(p, q, k, v, out_dtype, alibi_slopes, sinks, **run)
    if check_out_dtype(out_dtype) and p.dtype != FLOAT32:
        return _report_float32_out(p, q, k, v, alibi_slopes, sinks, **run)
    if method == "tiled":
        check_head_dim(p.d, "q")
        if config is not None:
            check_config(config)
    # Few query tokens over a long cache run the split-KV decode kernel (forward): its shared
    # memory, and by default the splits it picks on the modelled H200 (132 SMs).
    dec = None
    if method == "tiled" and config is None and pass_ in ("fwd", "fwd+bwd"):
        # an explicit split count models the launch with partials in memory (merged by the last split)
        dec = decode_launch(p.dtype, p.d, causal, p.batch, p.hq, p.hkv, p.nq, p.nk,
                             cluster=None if splits is None else False)
    if splits is None:
        splits = (getattr(config, "splits", None) or getattr(config, "num_splits", None)
                  or (dec.splits if dec and not dec.cluster else 1))
    splits = check_int("splits", splits, minimum=1)
    if registers is not None:
        registers = check_int("registers", registers, minimum=1)
    notes = []
    E = _pass_buffers(p, pass_, alibi_slopes, sinks)
    if method == "tiled":
        E += _tiled_buffers(p, pass_, causal, config, splits, registers, deterministic, dec, notes)
    else:
        E += _reference_buffers(p, pass_, notes)
    shape = dict(batch=p.batch, hq=p.hq, hkv=p.hkv, nq=p.nq, nk=p.nk, d=p.d)
    if dtype is None and not any(hasattr(x, "dtype") for x in (q, k, v)):
        notes.append("no arrays and no dtype given: bfloat16 assumed")
    return MemoryReport(method, pass_, dtype_name(p.dtype), shape, tuple(E), tuple(notes))


def _report_mla(p, out_dtype, alibi_slopes, sinks, v_aliases_k, *, method, pass_, causal, config, layout, splits,
                registers, deterministic):
    """MLA decoding's (576, 512): attn_decode_mla's buffers as plan.decode_mla lays out its launch."""
    for name, bad in (("method", method != "tiled"), ("pass_", pass_ != "fwd"), ("config", config is not None),
                      ("registers", registers is not None), ("out_dtype", check_out_dtype(out_dtype)),
                      ("alibi_slopes", alibi_slopes is not None), ("sinks", sinks is not None)):
        if bad:
            raise ValueError(f"{name}: MLA decode's head dims {MLA_HEAD_DIMS} are modelled for the kernel's forward "
                             "(method='tiled', pass_='fwd'; no config, registers, out_dtype or score modifiers)")
    if splits is not None:
        splits = check_int("splits", splits, minimum=1)
    p = SimpleNamespace(**vars(p), group=p.hq // p.hkv)  # (the plan's Problem fields)
    plan = decode_mla.launch_plan(p, H200_SM_COUNT, splits)
    s = p.dtype.itemsize
    rows = p.batch * p.hq * p.nq
    cache = p.batch * p.hkv * p.nk
    E = [MemoryEntry("Q", INPUT, rows * p.d * s, "B*Hq*Nq*d"),
         MemoryEntry("K", INPUT, cache * p.d * s, "B*Hkv*Nk*d: the latent cache"),
         MemoryEntry("V", INPUT, 0 if v_aliases_k else cache * p.dv * s,
                     f"v = k[..., :{p.dv}]: a view of K's memory" if v_aliases_k else "B*Hkv*Nk*dv"),
         MemoryEntry("O", OUTPUT, rows * p.dv * s, "B*Hq*Nq*dv"),
         MemoryEntry("LSE", SAVED, rows * LSE_ITEMSIZE, "float32 log-sum-exp, B*Hq*Nq*4: written by the forward")]
    if plan.splits > 1:
        E += [MemoryEntry("O partials", WORKSPACE, rows * plan.splits * p.dv * ACC_ITEMSIZE,
                          f"split-KV: float32 B*Hq*Nq*splits*dv, splits={plan.splits}, merged by attn_decode_combine"),
              MemoryEntry("LSE partials", WORKSPACE, rows * plan.splits * LSE_ITEMSIZE,
                          f"split-KV: float32 B*Hq*Nq*splits, splits={plan.splits}")]
    spec = decode_mla.kernel_spec(p.dtype, plan.row_tiles, causal is not None, v_aliases_k)
    E.append(MemoryEntry("shared memory / block (fwd)", ON_CHIP, spec.smem_bytes,
                         f"MLA decode: {16 * plan.row_tiles} packed (head, token) rows, {plan.row_blocks} row blocks, "
                         f"{plan.tile.block_n}-key stages; {spec.expression}"))
    shape = dict(batch=p.batch, hq=p.hq, hkv=p.hkv, nq=p.nq, nk=p.nk, d=p.d, dv=p.dv)
    return MemoryReport(method, pass_, dtype_name(p.dtype), shape, tuple(E), ())


def _report_head_dim_v(p, q, k, v, out_dtype, alibi_slopes, sinks, *, method, pass_, causal, config, layout,
                       splits, registers, deterministic):
    """v's head dim unlike q's: the report at one width, narrowed."""
    if check_out_dtype(out_dtype):
        raise ValueError("out_dtype: float32 output is not modelled with v's head dim unlike q's")
    w = max(p.d, p.dv)
    shapes = [as_shape_and_dtype(n, x)[0] for n, x in (("q", q), ("k", k), ("v", v))]
    wide = memory_report(*(s[:-1] + (w,) for s in shapes), method=method, pass_=pass_, dtype=p.dtype,
                         causal=causal, config=config, layout=layout, splits=splits, registers=registers,
                         deterministic=deterministic, alibi_slopes=alibi_slopes, sinks=sinks)
    # The forward on the dv kernel (no score modifiers, no forced tile or split count): no copies.
    native = (forward_dv_launch(p.dtype, p.d, p.dv, causal, p.nq, p.nk, p.batch, p.hq, p.hkv)
              if method == "tiled" and pass_ != "bwd" and config is None and splits is None
              and alibi_slopes is None and sinks is None else None)
    return _narrowed(wide, p.d, p.dv, method == "tiled", native, registers)


def _report_float32_out(p, q, k, v, alibi_slopes, sinks, *, method, pass_, causal, config, layout, splits,
                        registers, deterministic):
    """out_dtype=float32 with 16-bit inputs: the mma.sync kernel's float32 epilogue, or the inputs
    widened for the float32 kernels."""
    if method != "tiled" or pass_ != "fwd" or alibi_slopes is not None or sinks is not None:
        raise ValueError("out_dtype: float32 output is modelled for method='tiled', pass_='fwd' and no "
                         "score modifiers only")
    if p.d % 8 == 0 and config is None:  # attn_fwd_o32: the mma.sync kernel storing float32 o
        spec, t = plan_forward.forward_spec(p.dtype, p.d, causal is not None, True, o32=True)
        s16, q_elems = p.dtype.itemsize, p.batch * p.hq * p.nq * p.d
        kv_elems = p.batch * p.hkv * p.nk * p.d
        E = [MemoryEntry("Q", INPUT, q_elems * s16, "B*Hq*Nq*d"),
             MemoryEntry("K", INPUT, kv_elems * s16, "B*Hkv*Nk*d"),
             MemoryEntry("V", INPUT, kv_elems * s16, "B*Hkv*Nk*d"),
             MemoryEntry("O", OUTPUT, q_elems * 4, "float32 B*Hq*Nq*d (out_dtype=float32)"),
             MemoryEntry("LSE", SAVED, p.batch * p.hq * p.nq * LSE_ITEMSIZE,
                         "float32 log-sum-exp, B*Hq*Nq*4: written by the forward"),
             MemoryEntry("shared memory / block (fwd)", ON_CHIP, spec.smem_bytes,
                         f"{t.block_m} query rows x {t.block_n}-key tiles; {spec.short_name}")]
        shape = dict(batch=p.batch, hq=p.hq, hkv=p.hkv, nq=p.nq, nk=p.nk, d=p.d)
        return MemoryReport(method, pass_, dtype_name(p.dtype), shape, tuple(E),
                            ("out_dtype=float32: the mma.sync kernel with a float32 epilogue (aligned arrays "
                             "assumed; unaligned ones, kv_lens, paged caches, windows and packed sequences "
                             "widen the inputs: d not a multiple of 8 is modelled so)",))
    shapes = [as_shape_and_dtype(n, x)[0] for n, x in (("q", q), ("k", k), ("v", k if v is None else v))]
    wide = memory_report(*shapes, method=method, pass_=pass_, dtype=FLOAT32, causal=causal, config=config,
                         layout=layout, splits=splits, registers=registers, deterministic=deterministic)
    s16 = p.dtype.itemsize
    entries = []
    for e in wide.entries:
        if e.category == INPUT:  # the caller's 16-bit array, and its float32 copy
            entries.append(dataclasses.replace(e, bytes=e.bytes // 4 * s16))
            entries.append(MemoryEntry(f"{e.name} (float32 copy)", WORKSPACE, e.bytes,
                                       "widened exactly for the float32 kernels (out_dtype=float32)", phase="fwd"))
        else:
            entries.append(e)
    notes = wide.notes + (f"out_dtype=float32: {dtype_name(p.dtype)} inputs widened, the float32 kernels run",)
    return MemoryReport(method, pass_, dtype_name(p.dtype), wide.shape, tuple(entries), notes)


def _pass_buffers(p, pass_, alibi_slopes, sinks):
    """The inputs, outputs and saved state of a pass (the score modifiers' inputs checked)."""
    s = p.dtype.itemsize
    q_elems, kv_elems, rows = p.batch * p.hq * p.nq * p.d, p.batch * p.hkv * p.nk * p.d, p.batch * p.hq * p.nq
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    E = [MemoryEntry("Q", INPUT, q_elems * s, "B*Hq*Nq*d"),
         MemoryEntry("K", INPUT, kv_elems * s, "B*Hkv*Nk*d"),
         MemoryEntry("V", INPUT, kv_elems * s, "B*Hkv*Nk*d")]
    if bwd:
        if not fwd:
            E.append(MemoryEntry("O", INPUT, q_elems * s, "the forward's output, read by the backward"))
        E.append(MemoryEntry("dO", INPUT, q_elems * s, "upstream gradient, B*Hq*Nq*d"))
    for name, a, what in (("ALiBi slopes", alibi_slopes, "float32 (Hq,) or (B, Hq)"),
                          ("sinks", sinks, "float32 (Hq,)")):
        if a is not None:
            shape = tuple(a.shape) if hasattr(a, "shape") else tuple(int_list(name, a))
            if not shape or shape[-1] != p.hq or len(shape) > (2 if name != "sinks" else 1):
                raise ValueError(f"{'alibi_slopes' if name != 'sinks' else 'sinks'}: expected {what} with Hq = {p.hq}, "
                                 f"got shape {shape}")
            E.append(MemoryEntry(name, INPUT, math.prod(shape) * 4, what))
    if fwd:
        E.append(MemoryEntry("O", OUTPUT, q_elems * s, "B*Hq*Nq*d"))
    if bwd and sinks is not None:
        E.append(MemoryEntry("dsinks", OUTPUT, p.hq * 4, "float32 (Hq,)"))
    if bwd:
        E += [MemoryEntry("dQ", OUTPUT, q_elems * s, "B*Hq*Nq*d"),
              MemoryEntry("dK", OUTPUT, kv_elems * s, "B*Hkv*Nk*d (summed over the group's query heads)"),
              MemoryEntry("dV", OUTPUT, kv_elems * s, "B*Hkv*Nk*d (summed over the group's query heads)")]
    E.append(MemoryEntry("LSE", SAVED, rows * LSE_ITEMSIZE,
                         "float32 log-sum-exp, B*Hq*Nq*4: " + ("written by the forward" if fwd else "read by the backward")))
    return E


def _tiled_buffers(p, pass_, causal, config, splits, registers, deterministic, dec, notes):
    """The kernels' workspace and on-chip storage (``dec``: the split-KV decode launch, or None);
    appends to ``notes``."""
    rows = p.batch * p.hq * p.nq
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    E = []
    if fwd and splits > 1:
        E += [MemoryEntry("O partials", WORKSPACE, rows * splits * p.d * ACC_ITEMSIZE,
                          f"split-KV: float32 B*Hq*Nq*splits*d, splits={splits}", phase="fwd"),
              MemoryEntry("LSE partials", WORKSPACE, rows * splits * LSE_ITEMSIZE,
                          f"split-KV: float32 B*Hq*Nq*splits, splits={splits}", phase="fwd")]
        if dec is not None and dec.last_merges:
            notes.append("the last split of each (sequence, K/V head) merges the partials: it also keeps a "
                         "counter buffer (4 bytes a pair, at least 4 KiB) per device and stream from its first "
                         "launch on (zeroed again by every launch; not counted per call)")
    hd = schedule.head_dim_bucket(p.d)
    key_split = forward_key_split(p, causal) if fwd and config is None and dec is None else None
    if key_split is not None:
        slots, tile_rows, width = key_split
        E += [MemoryEntry("O partials (key split)", WORKSPACE, slots * tile_rows * width * ACC_ITEMSIZE,
                          f"float32 {slots} pieces x {tile_rows} rows x {width}: a grid under one wave splits its "
                          "query tiles by keys, all pieces of a tile but its last (plan.hopper.split_plan)", phase="fwd"),
              MemoryEntry("LSE partials (key split)", WORKSPACE, slots * tile_rows * LSE_ITEMSIZE,
                          f"float32 {slots} pieces x {tile_rows} rows", phase="fwd")]
        notes.append("the key split also keeps a 4 KiB counter buffer per device and stream from its first "
                     "launch on (zeroed again by every launch; not counted per call)")
    if bwd and p.dtype == FLOAT32:  # float32 kernels (plan.fp32): no dQ accumulator; float64 row statistics
        E += [MemoryEntry("LSE (float64)", WORKSPACE, rows * 8, "float64 log-sum-exp (base 2), B*Hq*Nq*8: the "
                          "saved LSE, replaced by the dQ kernel's recomputed one where it is this call's own",
                          phase="bwd"),
              MemoryEntry("D", WORKSPACE, rows * 8, "float64 rowsum(dO*O), B*Hq*Nq*8 (rowsum(P*dP) where the LSE "
                          "is replaced)", phase="bwd")]
    elif bwd:
        frag = backward_frag_dq(p.dtype, hd, causal, deterministic)
        width = dq_accumulator_width(p.dtype, hd, deterministic)
        dq_floats = schedule.dq_accumulator_floats(p.batch, p.hq, p.nq, width, frag)
        how = (f"float32 B*Hq*ceil(Nq/64)*64*{width} (the wgmma kernel's 64 x 64 fragment-order "
               "chunks, added by bulk reduce-adds)" if frag else f"float32 B*Hq*Nq*{width} (rows padded to the head-dim bucket"
               + (f", {width} for the wgmma kernel that runs it)" if width != hd else ")"))
        E += [MemoryEntry("dQ accumulator", WORKSPACE, dq_floats * ACC_ITEMSIZE, how + ", summed over K/V tiles",
                          phase="bwd"),
              MemoryEntry("D", WORKSPACE, rows * ACC_ITEMSIZE, "float32 rowsum(dO*O), B*Hq*Nq", phase="bwd")]
    if fwd and dec is not None:
        f = dec
        merge = f", {dec.splits} splits merged in a thread-block cluster" if dec.cluster else ""
        E.append(MemoryEntry("shared memory / block (fwd)", ON_CHIP, dec.smem,
                             f"split-KV decode: {dec.rows} packed (head, token) rows x {dec.block_n}-key tiles "
                             f"per warp, head dim padded to {hd}{merge}; {dec.source}"))
    elif fwd:
        f = forward_launch(p.dtype, p.d, causal, config, p.nq, p.nk, p.batch, p.hq)
        E.append(MemoryEntry("shared memory / block (fwd)", ON_CHIP, f.smem,
                             f"{f.block_m} query rows x {f.block_n}-key tiles, head dim padded to {hd}; {f.source}"))
    if fwd and registers is not None:
        E.append(MemoryEntry("registers / block (fwd)", ON_CHIP, registers * 4 * f.threads,
                             f"{registers} registers/thread x {f.threads} threads x 4 B"))
    if bwd:
        b = backward_launch(p.dtype, p.d, causal, deterministic)
        if b is None:
            notes.append(f"no {dtype_name(p.dtype)} GPU backward kernel: its on-chip storage is not reported "
                         "(device buffers as the 16-bit kernels allocate)")
        else:
            E.append(MemoryEntry("shared memory / block (bwd)", ON_CHIP, b.smem,
                                 f"{b.block_n} keys per block, {b.block_m}-row query tiles; {b.source}"))
            if b.dq_smem is not None:
                E.append(MemoryEntry("shared memory / block (bwd dQ)", ON_CHIP, b.dq_smem,
                                     ("float32 dQ kernel (row statistics, then dQ)" if b.fp64 else "deterministic dQ kernel")
                                     + f", {b.dq_block_m} rows x {b.dq_block_n}-key tiles"))
    return E


def _reference_buffers(p, pass_, notes):
    """The materializing reference's N x N intermediates (float32) and D; appends to ``notes``."""
    rows, nn = p.batch * p.hq * p.nq, p.batch * p.hq * p.nq * p.nk  # nn: one score-sized matrix per query head
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    E = []
    if fwd:
        E += [MemoryEntry("S", INTERMEDIATE, nn * 4, "float32 scores B*Hq*Nq*Nk (all pairs; masked after)", phase="fwd"),
              MemoryEntry("P", INTERMEDIATE, nn * 4, "float32 probabilities B*Hq*Nq*Nk", phase="fwd", reuses="S")]
    if bwd:
        E += [MemoryEntry("S (recomputed)", INTERMEDIATE, nn * 4, "float32 B*Hq*Nq*Nk", phase="bwd"),
              MemoryEntry("P (recomputed)", INTERMEDIATE, nn * 4, "float32 B*Hq*Nq*Nk", phase="bwd", reuses="S (recomputed)"),
              MemoryEntry("dP", INTERMEDIATE, nn * 4, "float32 dO V^T, B*Hq*Nq*Nk", phase="bwd"),
              MemoryEntry("dS", INTERMEDIATE, nn * 4, "float32 P*(dP - D), B*Hq*Nq*Nk", phase="bwd", reuses="dP"),
              MemoryEntry("D", WORKSPACE, rows * ACC_ITEMSIZE, "float32 rowsum(dO*O), B*Hq*Nq", phase="bwd")]
    notes.append("reference: the quadratic intermediates dominate; on-chip storage is the matmul library's")
    return E
