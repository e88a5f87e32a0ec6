"""io_model: the logical HBM traffic of a tile schedule, counted tile by tile, next to the
FlashAttention paper's bound and standard attention's count. A model, not a measurement."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..core import masks
from ..core.arrays import FLOAT32, dtype_name
from ..core.fp8_inputs import E4M3
from ..core.problem import MLA_DECODE_ONLY, MLA_HEAD_DIMS, MLA_MAX_QUERY_TOKENS
from ..plan import decode_mla, schedule
from .arguments import PASSES, check_choice, check_dtype, check_head_dim, check_heads, check_int, check_shape
from .e4m3 import io_model_e4m3
from .launches import (H200_SM_COUNT, H200_SMEM_PER_SM_BYTES, backward_frag_dq, backward_launch, backward_on_wgmma,
                       decode_launch, dq_accumulator_width, forward_key_split, forward_launch)
from .reports import ACC_ITEMSIZE, LSE_ITEMSIZE, IOEntry, IOModel
from .tile_walk import kv_tile_reads, paper_bound, visible_query_rows


def _check_kv_dtype(kv_dtype, dt, pass_, config) -> bool:
    """io_model's kv_dtype: None (k and v in ``dtype``) -> False, float8_e4m3fn with a 16-bit
    dtype and the forward alone -> True; else TypeError / ValueError naming it."""
    if kv_dtype is None:
        return False
    try:
        kdt = np.dtype(kv_dtype)
    except TypeError:
        kdt = None
    if kdt != np.dtype(E4M3):
        raise TypeError(f"kv_dtype: expected None or float8_e4m3fn, got {kv_dtype!r}")
    if dt == FLOAT32:
        raise ValueError("kv_dtype: an e4m3 cache goes with a float16 or bfloat16 q (dtype), not float32")
    if pass_ != "fwd" or config is not None:
        raise ValueError("kv_dtype: an e4m3 cache is modeled for the forward (pass_='fwd') of the decode kernel's "
                         "own launch (no config)")
    return True


def io_model(shape, config=None, *, dtype="bfloat16", causal=False, pass_="fwd", sram_bytes=None,
             nk=None, hkv=None, deterministic=False, kv_dtype=None, out_dtype=None, dv=None,
             v_aliases_k=True) -> IOModel:
    """Logical HBM traffic, in elements and bytes, of the tile schedule for ``shape = (B, H, N, d)``.

    ``nk`` sets a different key length (decoding: N new queries over a cache of nk keys); ``hkv``
    the K/V heads (GQA). Tiles are those cuflash launches (:func:`forward_launch`,
    :func:`backward_launch`); ``config`` (a TileConfig) replaces them in both passes.
    ``kv_dtype="float8_e4m3fn"``: an e4m3 K/V cache with a 16-bit q (decode shapes, the forward):
    K and V read at one byte per element by the e4m3 decode kernel's launch.
    ``dtype="float8_e4m3fn"``: q, k, v all e4m3, the e4m3 forward (pass_="fwd" only; no config or
    kv_dtype) on its table's tile (attn_fwd_wgmma_tma_fp8, 128 x 128), o in ``out_dtype`` (bfloat16
    by default, or float16): Q read once and K once per visible tile per query tile at one byte per
    element; vt built every call (V read once, vt written once: d rows of Nk rounded up to 32
    keys) and read by the kernel in V's place, up to that rounded key count; O and the float32 LSE
    written once. d % 16 != 0 adds the zero-padded copies of Q and K the kernel then reads (zeroed
    at ceil(d/16)*16 columns, d copied in), d % 8 != 0 an O scratch of ceil(d/8)*8 columns
    (zeroed, written by the kernel, copied into o).

    Forward: Q read once; each query tile (block_m rows) of each query head reads the K and V
    tiles it sees (every tile, or with ``causal`` only those for which cuflash.core.masks.tile_is_visible
    holds, counted tile by tile) — GQA heads each reread K/V; O and the float32 LSE written once.
    Backward: a preprocessing pass reads O and dO and writes D; one program per K/V tile and K/V head
    reads K and V once and, for each query head of its group, rereads Q, dO, LSE and D once per
    visible query tile and reads and writes the float32 dQ accumulator there (atomics; zeroed
    first, rows padded to the head-dim bucket); dK and dV written once; the accumulator is converted
    to dQ at the end. ``deterministic=True``: the main program leaves dQ alone and a dQ kernel reads
    Q, dO, LSE, D once and K, V once per query tile it sees, writing the accumulator once.

    Next to it: the FlashAttention paper's Theta(N^2 d^2 / M) accesses, evaluated with unit
    constant as Nq*Nk*d^2/M per head with M = ``sram_bytes`` / itemsize (default the H200's 228 KiB
    of shared memory per SM), standard attention's Theta(N d + N^2) as (Nq+Nk)*d + Nq*Nk, and the
    materializing reference's literal count (each N x N matrix written once and read once per use).
    """
    check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    shape = check_shape("shape", shape)
    if len(shape) != 4:
        raise ValueError(f"shape: expected (B, H, N, d), got {shape}")
    batch, hq, nq, d = shape
    if d == 0:
        raise ValueError("shape: head dim d must be at least 1")
    if (d, dv) == MLA_HEAD_DIMS:
        return _io_model_mla(batch, hq, nq, d, dv, dtype, causal, pass_, config, sram_bytes, nk, hkv, kv_dtype,
                             out_dtype, v_aliases_k)
    if dv is not None and dv != d:
        raise ValueError(f"dv: io_model models v's own head dim for MLA decode's {MLA_HEAD_DIMS} only, got ({d}, {dv})")
    check_head_dim(d, "shape")
    nk = nq if nk is None else check_int("nk", nk)
    hkv = hq if hkv is None else check_int("hkv", hkv)
    check_heads(hq, hkv, "hkv")
    dt = check_dtype("dtype", dtype, e4m3=True)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if dt == E4M3:
        return io_model_e4m3(batch, hq, hkv, nq, nk, d, causal, pass_, config, kv_dtype, out_dtype, sram_bytes)
    if out_dtype is not None:
        raise ValueError(f"out_dtype: taken with dtype float8_e4m3fn only ({dtype_name(dt)} o has q's dtype here)")
    s = dt.itemsize
    kv_e4m3 = _check_kv_dtype(kv_dtype, dt, pass_, config)
    fl = forward_launch(dt, d, causal, config, nq, nk, batch, hq)
    bm, bn, hd = fl.block_m, fl.block_n, fl.hd
    sram = H200_SMEM_PER_SM_BYTES if sram_bytes is None else check_int("sram_bytes", sram_bytes, minimum=1)
    M = max(1, sram // s)
    bh, bhkv = batch * hq, batch * hkv
    qe, kve, rows = bh * nq * d, bhkv * nk * d, bh * nq
    assumptions = []
    entries = []
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    prefix = (lambda ph: f"{ph}: ") if pass_ == "fwd+bwd" else (lambda ph: "")

    kv_keys, computed = kv_tile_reads(causal, nq, nk, bm, bn)
    computed *= bh
    dec = decode_launch(dt, d, causal, batch, hq, hkv, nq, nk, kv_e4m3=kv_e4m3) if config is None else None
    if kv_e4m3 and dec is None:
        raise ValueError(f"kv_dtype: an e4m3 cache runs the split-KV decode kernel only, which does not take "
                         f"shape {shape} with nk={nk}, hkv={hkv} (decode shapes, d a multiple of 16 up to 256)")
    skv = 1 if kv_e4m3 else s
    g = SimpleNamespace(batch=batch, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, s=s, bh=bh, bhkv=bhkv, qe=qe, kve=kve, rows=rows,
                        causal=causal, dt=dt, hd=hd, bm=bm, bn=bn)
    if fwd and dec is not None:
        entries += _decode_entries(g, dec, skv, kv_e4m3, prefix("fwd"), assumptions)
        computed = bh * masks.pair_count(causal, nq, nk)
    elif fwd:
        entries += _prefill_entries(g, config, kv_keys, fl, prefix("fwd"), assumptions)
    bbm = bbn = bwd_computed = 0
    if bwd:
        bwd_entries, bbm, bbn, bwd_computed = _backward_entries(g, config, deterministic, prefix("bwd"), assumptions)
        entries += bwd_entries
    # The materializing reference per query head. Forward: S = QK^T (read Q, K; write S), softmax
    # (read S; write P, LSE), O = PV (read P, V; write O). Backward: S recomputed and P formed (read
    # Q, K, S, LSE; write S, P), dP = dO V^T, D = rowsum(dO*O), dS = P*(dP - D), dV = P^T dO,
    # dQ = dS K, dK = dS^T Q: ten N x N accesses, 7 Nq*d, 5 Nk*d and 3 Nq (LSE, D write, D read).
    reference = 0
    if fwd:
        reference += bh * (4 * nq * nk + 2 * (nq + nk) * d + nq)
    if bwd:
        reference += bh * (10 * nq * nk + 7 * nq * d + 5 * nk * d + 3 * nq)
    paper, standard = paper_bound(assumptions, (int(fwd) + int(bwd)) * bh, nq, nk, d, M, sram, s, sram_bytes is None)
    compulsory = (qe + 2 * kve) * s + qe * s + rows * LSE_ITEMSIZE
    return IOModel(pass_, batch, hq, hkv, nq, nk, d, dtype_name(dt), causal, bm, bn, bbm, bbn, tuple(entries),
                   sram, M, paper, standard, reference, computed, bwd_computed, compulsory,
                   tuple(assumptions))


def _decode_entries(g, dec, skv, kv_e4m3, p, assumptions):
    """Split-KV decode: all query rows of a K/V head share one pass over its cache."""
    hq, hkv, nq, d, s, bhkv = g.hq, g.hkv, g.nq, g.d, g.s, g.bhkv
    qe, rows = g.qe, g.rows
    # partials go through memory only when the splits do not merge in a cluster
    part_rows = bhkv * dec.splits * (hq // hkv) * nq if dec.splits > 1 and not dec.cluster else 0
    rb = dec.row_blocks
    kv_note = ("once per K/V head (GQA rows packed into one tile)" if rb == 1 else
               f"once per K/V head and row block: {rb} blocks of {hq // hkv // rb} query heads each "
               "(reads after the first come from L2 when the row blocks run together)")
    entries = [
        IOEntry(p + "Q", qe, 0, s, "read once"),
        IOEntry(p + "K", rb * bhkv * dec.keys * d, 0, skv, kv_note + (", e4m3" if kv_e4m3 else "")),
        IOEntry(p + "V", rb * bhkv * dec.keys * d, 0, skv, "as K"),
        IOEntry(p + "O partials", part_rows * d, part_rows * d, ACC_ITEMSIZE,
                f"none: {dec.splits} splits merged in a thread-block cluster's shared memory" if dec.cluster
                else f"float32, {dec.splits} splits: written by the splits, read by the last of them"
                if dec.last_merges else f"float32, {dec.splits} splits: written by the splits, read by the combine"),
        IOEntry(p + "LSE partials", part_rows, part_rows, LSE_ITEMSIZE, "float32, written and read once"),
        IOEntry(p + "split counters", rb * bhkv * dec.splits if dec.last_merges else 0,
                rb * bhkv * (dec.splits + 1) if dec.last_merges else 0, 4,
                "int32 per (sequence, K/V head): an atomic add per split, the last split's reset"
                if dec.last_merges else "none: no merge by the last split"),
        IOEntry(p + "O", 0, qe, s, "written once"),
        IOEntry(p + "LSE", 0, rows, LSE_ITEMSIZE, "float32, written once"),
    ]
    assumptions.append(f"split-KV decode kernel ({dec.source}), {dec.splits} splits for "
                       f"{H200_SM_COUNT} SMs (the H200's; the launch reads the device's count)"
                       + ("; the splits merge in a thread-block cluster (distributed shared memory)"
                          if dec.cluster else ""))
    return entries


def _prefill_entries(g, config, kv_keys, fl, p, assumptions):
    """The forward: Q read once; each query tile of each query head reads the K/V tiles it sees."""
    batch, hq, nq, nk, d, s = g.batch, g.hq, g.nq, g.nk, g.d, g.s
    bh, qe, rows, causal, dt, bm = g.bh, g.qe, g.rows, g.causal, g.dt, g.bm
    bn = g.bn
    entries = [
        IOEntry(p + "Q", qe, 0, s, "read once"),
        IOEntry(p + "K", bh * kv_keys * d, 0, s, f"once per query tile ({bm} rows) per query head"),
        IOEntry(p + "V", bh * kv_keys * d, 0, s, f"once per query tile ({bm} rows) per query head"),
        IOEntry(p + "O", 0, qe, s, "written once"),
        IOEntry(p + "LSE", 0, rows, LSE_ITEMSIZE, "float32, written once"),
    ]
    split = (forward_key_split(SimpleNamespace(dtype=dt, batch=batch, hq=hq, nq=nq, nk=nk, d=d), causal)
             if config is None else None)
    if split is not None:  # query tiles split by keys: K/V still read once per tile
        slots, trows, width = split
        entries += [
            IOEntry(p + "Q (split pieces)", slots * trows * d, 0, s,
                    f"reread by {slots} pieces ({trows} rows each; a ragged last tile reads fewer)"),
            IOEntry(p + "O partials (key split)", slots * trows * width, slots * trows * width, ACC_ITEMSIZE,
                    "float32: written by a tile's pieces but its last, read by the last"),
            IOEntry(p + "LSE partials (key split)", slots * trows, slots * trows, LSE_ITEMSIZE,
                    "float32, written and read once"),
        ]
        assumptions.append(f"key split on {H200_SM_COUNT} SMs (the H200's): {slots} partial pieces")
    assumptions.append(f"forward tile {bm}x{bn} from {fl.source}; every query head rereads its K/V tiles "
                       "(GQA heads share no loads)")
    if causal is not None:
        assumptions.append("causal: only K/V tiles with masks.tile_is_visible are loaded")
    return entries


def _backward_entries(g, config, deterministic, p, assumptions):
    """The backward: D's preprocessing, one program per K/V tile and K/V head over the query tiles
    that see it, dQ by atomics, fragment-order bulk adds or the deterministic kernel.
    Returns (entries, block_m, block_n, computed pairs)."""
    batch, hq, nq, nk, d, s = g.batch, g.hq, g.nq, g.nk, g.d, g.s
    bh, qe, kve, rows, causal, dt = g.bh, g.qe, g.kve, g.rows, g.causal, g.dt
    hd, bm, bn = g.hd, g.bm, g.bn
    entries = []
    bl = backward_launch(dt, d, causal, deterministic) if config is None else None
    if config is not None:
        bbm, bbn, src = config.block_m, config.block_n, "config"
    elif bl is not None:
        bbm, bbn, src = bl.block_m, bl.block_n, bl.source
    else:
        bbm, bbn, src = bm, bn, f"the forward's tile (no {dtype_name(dt)} GPU backward kernel)"
    q_rows = bwd_computed = visited = 0  # query rows revisited, summed over K/V tiles; tiles with any
    for col0 in range(0, nk, bbn):
        r = visible_query_rows(causal, nq, nk, col0, bbm)
        q_rows += r
        visited += r > 0
        bwd_computed += r * (min(nk, col0 + bbn) - col0)
    bwd_computed *= bh
    if bl is not None and bl.fp64:  # float32 kernels: the dQ kernel's two passes form LSE and D itself
        dq_keys, _ = kv_tile_reads(causal, nq, nk, bl.dq_block_m, bl.dq_block_n)
        entries += [
            IOEntry(p + "Q (dQ kernel)", qe, 0, s, "read once"),
            IOEntry(p + "dO (dQ kernel)", qe, 0, s, "read once"),
            IOEntry(p + "K (dQ kernel)", 2 * bh * dq_keys * d, 0, s,
                    f"twice (statistics, then dQ) per query tile ({bl.dq_block_m} rows) per query head"),
            IOEntry(p + "V (dQ kernel)", 2 * bh * dq_keys * d, 0, s, "twice per query tile per query head"),
            IOEntry(p + "O, dO (given D)", 2 * qe, 0, s, "read once: float64 rowsum(dO*O) of the given o"),
            IOEntry(p + "LSE (given)", rows, 0, LSE_ITEMSIZE, "the given float32 lse, read once"),
            IOEntry(p + "LSE, D (given, float64)", 2 * rows, 2 * rows, 8,
                    "written by the host's prefill, read once by the dQ kernel"),
            IOEntry(p + "LSE, D", 2 * bh * q_rows, 2 * rows, 8,
                    "float64: written once by the dQ kernel, reread per visible K/V tile"),
            IOEntry(p + "K", kve, 0, s, "read once per K/V tile"),
            IOEntry(p + "V", kve, 0, s, "read once per K/V tile"),
            IOEntry(p + "Q", bh * q_rows * d, 0, s, f"reread once per visible K/V tile ({bbn} keys)"),
            IOEntry(p + "dO", bh * q_rows * d, 0, s, "reread once per visible K/V tile"),
            IOEntry(p + "dQ", 0, qe, s, "written once"),
            IOEntry(p + "dK", 0, kve, s, "written once (group's query heads summed on chip)"),
            IOEntry(p + "dV", 0, kve, s, "written once (group's query heads summed on chip)"),
        ]
        assumptions.append("float32 backward: O and the saved LSE are not read")
    if not (bl is not None and bl.fp64):
        entries += [
            IOEntry(p + "O (preprocess)", qe, 0, s, "read once to form D = rowsum(dO*O)"),
            IOEntry(p + "dO (preprocess)", qe, 0, s, "read once to form D"),
            IOEntry(p + "K", kve, 0, s, "read once per K/V tile"),
            IOEntry(p + "V", kve, 0, s, "read once per K/V tile"),
            IOEntry(p + "Q", bh * q_rows * d, 0, s, f"reread once per visible K/V tile ({bbn} keys)"),
            IOEntry(p + "dO", bh * q_rows * d, 0, s, "reread once per visible K/V tile"),
            IOEntry(p + "LSE", bh * q_rows, 0, LSE_ITEMSIZE, "float32, reread once per visible K/V tile"),
            IOEntry(p + "D", bh * q_rows, rows, ACC_ITEMSIZE, "float32: written once, reread per visible K/V tile"),
        ]
        if not deterministic and config is None and backward_frag_dq(dt, hd, causal, deterministic):
            # bulk reduce-adds of whole 64 x 64 chunks: every column of the bucket, rows to a multiple of 64
            # (the kernel's HEAD_DIM columns: 192 runs the 256 kernel)
            pad = -(-nq // 64) * 64 - nq
            width = dq_accumulator_width(dt, hd, deterministic, causal)
            added = bh * (q_rows + visited * pad) * width
            entries.append(IOEntry(p + "dQ accumulator", added + qe, schedule.dq_accumulator_floats(batch, hq, nq, width, True)
                                   + added, ACC_ITEMSIZE, f"float32, fragment order: zeroed (Nq padded to 64, {width} "
                                   "columns), read+written per visible tile (64 x 64 bulk reduce-adds), read once to convert"))
        elif not deterministic:
            # the wgmma K/V kernel adds every column of its HEAD_DIM (192: 256), the mma.sync one d
            hopper = config is None and backward_on_wgmma(dt, hd, causal, deterministic)
            width = schedule.dq_accumulator_width(hd, hopper)
            cols = width if hopper else d
            entries.append(IOEntry(p + "dQ accumulator", bh * q_rows * cols + qe, rows * width + bh * q_rows * cols,
                                   ACC_ITEMSIZE, f"float32: zeroed ({width}-wide rows), {cols} columns read+written "
                                   "per visible tile (atomics), read once to convert"))
        else:
            dbm = bl.dq_block_m if bl is not None and bl.dq_block_m else bm
            dbn = bl.dq_block_n if bl is not None and bl.dq_block_n else bn
            dq_keys, _ = kv_tile_reads(causal, nq, nk, dbm, dbn)
            entries += [
                IOEntry(p + "Q (dQ kernel)", qe, 0, s, "read once"),
                IOEntry(p + "dO (dQ kernel)", qe, 0, s, "read once"),
                IOEntry(p + "LSE, D (dQ kernel)", 2 * rows, 0, LSE_ITEMSIZE, "float32, read once each"),
                IOEntry(p + "K (dQ kernel)", bh * dq_keys * d, 0, s, f"once per query tile ({dbm} rows) per query head"),
                IOEntry(p + "V (dQ kernel)", bh * dq_keys * d, 0, s, f"once per query tile ({dbm} rows) per query head"),
                IOEntry(p + "dQ accumulator", qe, qe, ACC_ITEMSIZE, "float32: written once, read once to convert"),
            ]
        entries += [
            IOEntry(p + "dQ", 0, qe, s, "written once"),
            IOEntry(p + "dK", 0, kve, s, "written once (group's query heads summed on chip)"),
            IOEntry(p + "dV", 0, kve, s, "written once (group's query heads summed on chip)"),
        ]
    assumptions.append(f"backward tile {bbm}x{bbn} from {src}: one program per K/V tile and K/V head loops "
                       "over the group's query heads")
    if causal is not None:
        assumptions.append("causal backward: a K/V tile revisits only the query tiles that see it")
    return entries, bbm, bbn, bwd_computed


def _io_model_mla(batch, hq, nq, d, dv, dtype, causal, pass_, config, sram_bytes, nk, hkv, kv_dtype, out_dtype,
                  v_aliases_k) -> IOModel:
    """io_model of MLA decoding (attn_decode_mla; plan.decode_mla): Q (576 wide) read once; the cache
    read once per K/V head and row block - 576 columns per key, V taken from K's rows in shared
    memory when v aliases k (v = k[..., :512]), else V's 512 columns read too; the splits' float32
    partial O (512 wide) and LSE written once and read once by attn_decode_combine; O (512 wide)
    and LSE written once."""
    if pass_ != "fwd" or config is not None or kv_dtype is not None or out_dtype is not None:
        raise ValueError(f"shape: MLA decode's head dims {MLA_HEAD_DIMS} are modeled for the forward's own launch "
                         "(pass_='fwd'; no config, kv_dtype or out_dtype)")
    nk = nq if nk is None else check_int("nk", nk)
    hkv = hq if hkv is None else check_int("hkv", hkv)
    check_heads(hq, hkv, "hkv")
    dt = check_dtype("dtype", dtype)
    if dt == FLOAT32 or nq > MLA_MAX_QUERY_TOKENS:
        raise ValueError(f"shape: {MLA_DECODE_ONLY}")
    s = dt.itemsize
    p = SimpleNamespace(batch=batch, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv, group=hq // hkv)
    plan = decode_mla.launch_plan(p, H200_SM_COUNT)
    rb, bh = plan.row_blocks, batch * hq
    qe, oe, rows = bh * nq * d, bh * nq * dv, bh * nq
    part_rows = rows * plan.splits if plan.splits > 1 else 0
    cache = rb * batch * hkv * nk
    again = "" if rb == 1 else f" (x{rb} row blocks; reads after the first come from L2 when they run together)"
    entries = [
        IOEntry("Q", qe, 0, s, "read once"),
        IOEntry("K", cache * d, 0, s, f"the cache's {d} columns, once per K/V head" + again),
        IOEntry("V", 0 if v_aliases_k else cache * dv, 0, s,
                f"none: v = k[..., :{dv}], P V reads V from the K tile in shared memory" if v_aliases_k
                else f"{dv} columns per key, once per K/V head" + again),
        IOEntry("O partials", part_rows * dv, part_rows * dv, ACC_ITEMSIZE,
                f"float32, {plan.splits} splits: written by the splits, read by the combine"),
        IOEntry("LSE partials", part_rows, part_rows, LSE_ITEMSIZE, "float32, written and read once"),
        IOEntry("O", 0, oe, s, "written once"),
        IOEntry("LSE", 0, rows, LSE_ITEMSIZE, "float32, written once"),
    ]
    assumptions = [f"MLA decode kernel (attn_decode_mla.cu), {plan.splits} splits, {rb} row blocks of "
                   f"{plan.row_tiles} row tiles for {H200_SM_COUNT} SMs (the H200's)"]
    sram = H200_SMEM_PER_SM_BYTES if sram_bytes is None else check_int("sram_bytes", sram_bytes, minimum=1)
    M = max(1, sram // s)
    paper, standard = paper_bound(assumptions, bh, nq, nk, d, M, sram, s, sram_bytes is None)
    kv_once = batch * hkv * nk * (d if v_aliases_k else d + dv)
    compulsory = (qe + kv_once + oe) * s + rows * LSE_ITEMSIZE
    reference = bh * (4 * nq * nk + (nq + nk) * d + (nq + nk) * dv + nq)
    computed = bh * masks.pair_count(causal, nq, nk)
    return IOModel("fwd", batch, hq, hkv, nq, nk, d, dtype_name(dt), causal, 16 * plan.row_tiles,
                   plan.tile.block_n, 0, 0, tuple(entries), sram, M, paper, standard, reference, computed, 0,
                   compulsory, tuple(assumptions))
