"""The public functions: validate, pick the backend from the array library, run."""

from __future__ import annotations

import numpy as np

from ..backends import cuda
from ..backends import numpy as numpy_backend
from ..core import fp8_inputs
from ..core import problem as _problem
from ..core.arrays import FLOAT32, array_namespace, may_share_memory, widen_to_float32
from ..core.layout import from_bhsd, is_view_of, to_bhsd
from . import fp8_checks, interop, plan_cache
from .prepared import PreparedAttention


def _backend(p):
    return numpy_backend if p.xp is np else cuda


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, out=None,
              kv_lens=None, validate=True, window=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
              softcap=None, alibi_slopes=None, sinks=None, out_dtype=None, q_descale=None, k_descale=None,
              v_descale=None, max_seqlen_q=None, max_seqlen_k=None):
    """Exact softmax attention ``softmax(scale * q k^T [masked]) v`` without materializing scores.

    Parameters
    ----------
    q : array (..., Hq, Nq, d) for ``layout="bhsd"`` or (..., Nq, Hq, d) for ``"bshd"``; a 2-D
        (Nq, d) array is a single head. NumPy arrays run the NumPy tiled backend, CuPy arrays the
        CUDA kernels. torch tensors, JAX arrays and other ``__dlpack__`` /
        ``__cuda_array_interface__`` producers are used without copies, on their device and (torch)
        current stream, and results come back as the caller's kind of array (cuflash.api.interop).
    k, v : arrays (..., Hkv, Nk, d) (or (..., Nk, Hkv, d)); Hq must be a multiple of Hkv (GQA/MQA).
    causal : False, True / "bottom_right" (query i sees keys j <= i + Nk - Nq, FlashAttention's
        convention) or "top_left" (j <= i, torch SDPA's). Rows that see no key give o = 0 and
        lse = -inf.
    scale : multiplier of the scores, default 1/sqrt(d).
    layout : "bhsd" or "bshd".
    return_lse : also return the float32 natural-log log-sum-exp, shape (..., Hq, Nq).
    out : optional array of q's shape and dtype to write o into (must not overlap an input).
    kv_lens : optional int32 array of q's batch shape: sequence b attends to its first
        kv_lens[b] keys only (a KV cache filled to different lengths); keys beyond are never
        read. Causal alignment is per sequence (bottom-right: the last query sees key
        kv_lens[b] - 1). Few query tokens against a long cache run the split-KV decode kernel.
    validate : check kv_lens on the host (0 <= kv_lens <= Nk). For CuPy inputs that costs one
        device-to-host copy; validate=False skips it (out-of-range values are then clamped to
        Nk by the decode kernel; the prefill fallback copies kv_lens to the host anyway).
        CUDA graph capture: a call that needs no host read (validate=False; decode shapes with
        kv_lens or a block table; cu_seqlens_* only with max_seqlen_q and max_seqlen_k) can be
        captured and replayed; a host read
        inside a capture raises ValueError naming the argument. Capture with
        cupy.cuda.MemoryAsyncPool as the allocator, so that the graph owns the buffers a call
        allocates (lse, split-KV partials); with another allocator a RuntimeWarning says so.
        torch tensors allocate through torch's caching allocator, so torch's captures
        (torch.cuda.graph, torch.compile(mode="reduce-overhead")) own them with no setup.
    window : optional (left, right) ints >= -1, FlashAttention's sliding window: query i sees key
        j only if diag - left <= j <= diag + right, diag = i + Nk - Nq (bottom-right, also without
        causal; i for causal="top_left"); -1 leaves a side unbounded, (-1, -1) is no window. With
        causal the right end is the smaller bound. Defined by cuflash.core.masks.row_bounds; checked
        on the host without any copy (TypeError / ValueError).
    cu_seqlens_q, cu_seqlens_k : optional int32 1-D arrays of B + 1 offsets (FlashAttention's
        varlen API): q is then packed (total_q, Hq, d) and k, v (total_k, Hkv, d) - the "bshd"
        layout without a batch axis, whatever ``layout`` says - and sequence b is q rows
        [cu_seqlens_q[b], cu_seqlens_q[b+1]) attending only to k/v rows [cu_seqlens_k[b],
        cu_seqlens_k[b+1]), with causal/window alignment per sequence; empty sequences are
        allowed. o is (total_q, Hq, d) and lse (Hq, total_q), as FlashAttention's varlen returns
        it. Not combinable with kv_lens. Dtype, 1-D shape and equal lengths are checked without a
        copy; the values (start at 0, non-decreasing, last = total) are read on the host and
        checked: the CPU backend loops over them, and the GPU's single launch needs the longest
        sequence for its grid, so CuPy offsets cost one device-to-host copy, also with
        validate=False unless max_seqlen_q and max_seqlen_k are given (below). On the GPU, cu_seqlens_* and windows (but in decode shapes, which the
        split-KV kernel runs with its band mask) run the band kernels (float16/bfloat16:
        the forward on wgmma on sm_90 where it applies, else mma.sync; the backward on mma.sync;
        float8_e4m3fn: the e4m3 band kernel on sm_90; float32 GPU inputs raise
        NotImplementedError).
    max_seqlen_q, max_seqlen_k : optional ints with cu_seqlens_* (FlashAttention's varlen
        arguments): the longest packed q and k sequence. With validate=True the offsets are read
        and checked as above and each given value must be at least the longest sequence
        (ValueError naming it); the GPU's grid then covers the given lengths. With both given,
        validate=False and device offsets, the offsets are not read on the host: the call needs no
        device-to-host copy and can be captured in a CUDA graph. Their values are then the
        caller's promise: a device pass clamps the offsets into the packed arrays before the
        kernels read them (each offset into [0, total], then raised to the largest before it, so
        no access falls outside the arrays), and rows of a q sequence longer than max_seqlen_q
        are not computed (nor keys past max_seqlen_k in the backward's key blocks).
    block_table : optional int32 (B, max_blocks): k and v are then a paged KV cache, each
        (num_blocks, block_size, Hkv, d) with block_size a power of two >= 16, and sequence b's
        key j is row j % block_size of page block_table[b, j // block_size]; Nk = max_blocks *
        block_size, and kv_lens (default Nk) says how many keys each sequence has. q must be 4-D.
        Only the pages a sequence uses are looked up (others may hold anything, e.g. -1). With
        validate=True those entries are checked on the host (one device-to-host copy for CuPy).
        Decode shapes run the split-KV kernel reading the pages in place (with a ``window`` too,
        aligned on each sequence's kv_lens[b] keys as with kv_lens alone, and only the pages the
        window reaches); other shapes and the NumPy backend gather each sequence's used pages into
        a contiguous copy first.
    softcap : optional float > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2,
        Grok), before the ALiBi bias and the mask.
    alibi_slopes : optional float32 array (Hq,) or (B, Hq) (B: q's batch, or the number of packed
        sequences with cu_seqlens_*), FlashAttention-2's ALiBi: the score of query i and key j
        gets the bias -slope * |i + Nk - Nq - j|, with Nq, Nk each sequence's own lengths
        (kv_lens, cu_seqlens_*, a paged cache's kv_lens), whatever the causal alignment.
    sinks : optional float32 array (Hq,) of attention-sink logits (gpt-oss): one more "key" per
        query head with this logit (not scaled, capped or biased) that joins every row's softmax
        denominator and contributes no value. The returned lse includes the sink; a row that sees
        no key then gives o = 0 and lse = sinks[h].
        alibi_slopes and sinks must be arrays of q's library and device; their values are not
        checked.

    out_dtype : None (q's dtype) or float32: o's dtype. float32 with float16/bfloat16 inputs keeps
        o unrounded to 16 bits, e.g. for partial results that :func:`merge_attention_states` merges.
        The NumPy backend stores its float32 accumulator. On the GPU, plain shapes (no kv_lens,
        block_table, window or cu_seqlens_*; 16-byte aligned operands, d a multiple of 8) run the
        16-bit mma.sync kernel with a float32 epilogue (attn_fwd_o32: the accumulator stored
        unrounded; not the Hopper wgmma or split-KV decode kernels). Other calls widen the inputs
        to float32 (exactly) and run the float32 kernels (float64 arithmetic, o rounded once):
        exact but several times slower, and window= / cu_seqlens_* then raise
        NotImplementedError as for float32 inputs. ``out`` must then be float32.
    q_descale, k_descale, v_descale : with ``float8_e4m3fn`` q, k, v: float32 factors, each input
        standing for ``x8 * descale`` (cuflash.fp8.quantize makes both). Shape () or (1,) per
        tensor, or per batch entry and head: the input's batch axes + (H,), for q also + (Hkv,)
        (FlashAttention-3's form). None: 1.
        NumPy arrays (ml_dtypes' float8_e4m3fn; descales NumPy float32, checked finite): the NumPy
        backend, every option; packed sequences and paged caches take per-tensor factors. The
        scores, softmax and o are computed from the dequantized float32 values; o is bfloat16
        (out_dtype: bfloat16, float16 or float32), rounded once from float32. A float16/bfloat16
        q with e4m3 k and v (an FP8 KV cache) takes no q_descale, and o has q's dtype by default.
        GPU arrays: the e4m3 kernel on Hopper (sm_90; docs/fp8.md): CuPy holds e4m3 as uint8
        bits, which a call marks as e4m3 by passing descales (arrays of the inputs' library and
        device, values not read on the host; 1 for unscaled inputs); torch float8_e4m3fn tensors
        need none. Causal masks, windows and packed sequences (cu_seqlens_*, one launch; one
        descale per tensor) as for 16-bit inputs, and kv_lens (each batch entry over its first
        kv_lens[b] keys, one launch per entry: kv_lens is read on the host, as by the 16-bit
        prefill path); GQA, d <= 256, any strides; o bfloat16 or float16 (out_dtype), lse
        float32; block_table, softcap, alibi_slopes, sinks and out_dtype=float32 raise
        NotImplementedError, other GPUs too. Its arithmetic is cuflash.fp8.emulate_attention's
        (window= and a packed sequence's keys as its mask).
        An FP8 KV cache on the GPU (a 16-bit q with e4m3 k and v, contiguous or paged; k_descale
        and v_descale per tensor, or per sequence and K/V head for a contiguous cache) runs the
        split-KV decode kernel in decode shapes (kv_lens, causal, windows; o in q's dtype); other
        shapes and score modifiers raise NotImplementedError.

    Returns
    -------
    o, or (o, lse). dtypes float16, bfloat16 (ml_dtypes) and float32; o has q's dtype (or out_dtype).

    A decode geometry called twice (CuPy arrays or CUDA torch tensors with the same shapes,
    strides, dtypes, device and options; an FP8 KV cache's k_descale / v_descale with the same
    geometry too) is planned once, and later calls launch from the plan
    (cuflash.api.plan_cache): the same checks and results, less host time. ``CUFLASH_PLAN_CACHE=0``
    turns that off.
    """
    mods = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    # The calls a plan may serve (cuflash.api.plan_cache): no packed sequences or score modifiers.
    plannable = cu_seqlens_q is None and cu_seqlens_k is None and softcap is None and alibi_slopes is None \
        and sinks is None and max_seqlen_q is None and max_seqlen_k is None
    if fp8_inputs.requested((q, k, v), (q_descale, k_descale, v_descale)):
        if plannable and q_descale is None and out_dtype is None:  # (an FP8 KV cache's decode geometry)
            planned = plan_cache.run(q, k, v, kv_lens, block_table, out,
                                     (causal, scale, layout, return_lse, validate, window), (k_descale, v_descale))
            if planned is not plan_cache.MISS:
                return planned
        return _attention_fp8(q, k, v, (q_descale, k_descale, v_descale), out_dtype, out, return_lse,
                              dict(causal=causal, scale=scale, layout=layout, kv_lens=kv_lens, validate=validate,
                                   window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   **mods))
    if _problem.check_out_dtype(out_dtype):
        return _attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=return_lse, out=out,
                          kv_lens=kv_lens, validate=validate, window=window, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, block_table=block_table, out_dtype=FLOAT32,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **mods)
    if plannable:
        planned = plan_cache.run(q, k, v, kv_lens, block_table, out,
                                 (causal, scale, layout, return_lse, validate, window))
        if planned is not plan_cache.MISS:
            return planned
    return _attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=return_lse, out=out,
                      kv_lens=kv_lens, validate=validate, window=window, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, block_table=block_table, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, **mods)


def _attention_fp8(q, k, v, descales, out_dtype, out, return_lse, options):
    """attention of float8_e4m3fn inputs (core.fp8_inputs). GPU arrays: the e4m3 kernel
    (_attention_fp8_gpu). NumPy arrays: dequantized to float32 by their descale factors, the
    float32 path (float64 arithmetic on the NumPy backend, o rounded once to float32), then o
    rounded once to the output dtype."""
    if fp8_inputs.on_gpu((q, k, v)):
        q, k, v = (fp8_inputs.as_bits(a) for a in (q, k, v))
        return _attention_fp8_gpu(q, k, v, *descales, out_dtype=out_dtype, out=out, return_lse=return_lse, **options)
    layout = options["layout"]
    dense = options["cu_seqlens_q"] is None and options["cu_seqlens_k"] is None and options["block_table"] is None
    odt, checked = fp8_checks.check_host((q, k, v), descales, out_dtype, layout, dense)
    group = fp8_inputs.group_of(q, k, layout) if dense else 1
    # (an FP8 KV cache's 16-bit q is widened exactly)
    wide = [widen_to_float32(a) if d is None else
            fp8_inputs.dequantize(a, d, layout=layout, group=group if name == "q" else 1)
            for name, a, d in zip(fp8_inputs.NAMES, (q, k, v), checked)]
    if out is not None:  # o has q's shape with v's head dim in every input form
        _problem.check_out("out", out, q.shape[:-1] + v.shape[-1:], odt, np, (("q", q), ("k", k), ("v", v)))
    o32, lse = _attention(*wide, return_lse=True, **options)
    if out is not None:
        out[...] = o32.astype(odt)
        o = out
    else:
        o = o32 if odt == FLOAT32 else o32.astype(odt)
    return (o, lse) if return_lse else o


@interop.accepts_foreign_arrays("q", "k", "v", "q_descale", "k_descale", "v_descale", "kv_lens", "block_table",
                                "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks", outputs=("out",))
def _attention_fp8_gpu(q, k, v, q_descale, k_descale, v_descale, *, out_dtype, out, return_lse, causal, scale, layout,
                       validate, kv_lens, window, cu_seqlens_q, cu_seqlens_k, block_table, softcap, alibi_slopes,
                       sinks, max_seqlen_q=None, max_seqlen_k=None):
    """float8_e4m3fn GPU inputs (CuPy uint8 bits; torch float8_e4m3fn tensors arrive as uint8 views)
    on the e4m3 kernels: causal masks, windows, packed sequences (_fp8_varlen_on_gpu) and kv_lens
    (each batch entry over its first kv_lens[b] keys, as the 16-bit prefill fallback); other options
    raise NotImplementedError naming themselves (core.fp8_inputs.GPU_OPTIONS)."""
    options = dict(kv_lens=kv_lens, window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   block_table=block_table, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    max_seqlens = _problem.check_max_seqlens(max_seqlen_q, max_seqlen_k,
                                             packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    if all(isinstance(a, np.ndarray) for a in (q, k, v)):  # torch CPU tensors: their bits as NumPy e4m3
        q, k, v = (a.view(fp8_inputs.E4M3) if a.dtype == np.uint8 else a for a in (q, k, v))
        return _attention_fp8(q, k, v, (q_descale, k_descale, v_descale), out_dtype, out, return_lse,
                              dict(causal=causal, scale=scale, layout=layout, validate=validate, **options,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
    _problem.check_flag("return_lse", return_lse)
    _problem.check_flag("validate", validate)
    if fp8_inputs.kv_cache_only((q, k, v)):
        return _fp8_cache_on_gpu(q, k, v, (q_descale, k_descale, v_descale), out_dtype, out, return_lse,
                                 dict(causal=causal, scale=scale, layout=layout, validate=validate, **options))
    fp8_inputs.refuse_gpu_options(options)
    _problem.check_layout(layout)
    _problem.same_library((("q", q), ("k", k), ("v", v)))
    odt = fp8_inputs.check_gpu_call((q, k, v), out_dtype)
    descales = (q_descale, k_descale, v_descale)
    shape_opts = dict(causal=causal, scale=scale, layout=layout, window=window, element=fp8_inputs.E4M3)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _fp8_varlen_on_gpu(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, odt, out, return_lse, kv_lens,
                                  dict(shape_opts, max_seqlens=max_seqlens, validate=validate))
    p = _problem.validate_forward(q, k, v, **shape_opts)
    _fp8_same_head_dims(p)
    descales = fp8_inputs.checked_gpu_descales((q, k, v), descales, layout, p.xp)
    _problem.check_out("out", out, p.o_shape(), odt, p.xp, (("q", q), ("k", k), ("v", v)))
    o, o4, direct, lse3 = _forward_outputs(p, out, odt)
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    lens_dev, lens_host = _problem.check_kv_lens(kv_lens, p, validate)
    if lens_dev is None:
        cuda.forward_fp8(p, q4, k4, v4, o4, lse3, descales)
        return _forward_result(p, o, o4, direct, lse3, return_lse)
    _each_sequence_over_its_keys(p, q4, k4, v4, o4, lse3, lens_dev, lens_host, lambda pb, b, *views:
                                 cuda.forward_fp8(pb, *views, fp8_inputs.batch_entry_descales(descales, b)))
    return _forward_result(p, o, o4, direct, lse3, return_lse)


def _fp8_same_head_dims(p):
    if p.dv != p.d:
        raise NotImplementedError(f"v: a head dim ({p.dv}) other than q's ({p.d}) is not implemented for "
                                  "float8_e4m3fn GPU inputs")


def _fp8_varlen_on_gpu(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, odt, out, return_lse, kv_lens, shape_opts):
    """Packed e4m3 sequences on the GPU: one launch of the e4m3 band kernel over all of them, as
    _attention_varlen's 16-bit GPU path (o (total_q, Hq, d), lse (Hq, total_q)); one descale per
    tensor."""
    max_seqlens = shape_opts["max_seqlens"]
    p, spans = _problem.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens=kv_lens, **shape_opts)
    _fp8_same_head_dims(p)
    descales = fp8_inputs.checked_gpu_descales((q, k, v), descales, "bshd", p.xp, dense=False)
    _problem.check_out("out", out, p.o_shape(), odt, p.xp, (("q", q), ("k", k), ("v", v)))
    o = out if out is not None else p.xp.empty(p.o_shape(), dtype=odt)
    lse = p.xp.empty(p.lse_shape(), dtype=np.float32)
    _packed_on_gpu(p, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, spans, max_seqlens,
                   lambda *views, **packed: cuda.forward_fp8(*views, descales, **packed))
    return (o, lse) if return_lse else o


def _fp8_cache_on_gpu(q, k, v, descales, out_dtype, out, return_lse, options):
    """A 16-bit GPU q with an e4m3 K/V cache (contiguous or paged; e4m3 bits as uint8): the split-KV
    decode kernel reads the cache's bytes (attn_decode_kv8). The arguments are checked as
    fp8_checks.check_gpu_cache says (prepared calls run the same checks)."""
    import cupy

    p, bs, kd, vd = fp8_checks.check_gpu_cache(q, k, v, descales, out_dtype, options)
    odt = q.dtype
    block_table, validate = options["block_table"], options["validate"]
    _problem.check_out("out", out, p.o_shape(), odt, cupy, (("q", q), ("k", k), ("v", v)))
    lens_dev, lens_host = _problem.check_kv_lens(options["kv_lens"], p, validate)
    if block_table is not None:
        if validate:
            lens = lens_host if lens_host is not None else np.full(p.batch, p.nk, dtype=np.int64)
            _problem.check_block_table(block_table, lens, bs, k.shape[0])
        k4, v4, paged = k, v, (cupy.ascontiguousarray(block_table), bs)
    else:
        k4, v4, paged = to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk), None
    if not cuda.decode_applies_e4m3(p, k4, v4):
        raise NotImplementedError(
            "k, v: an FP8 KV cache runs on the GPU in the split-KV decode kernel only: at most 16 query tokens "
            "per K/V head's rows, at least 256 keys, head dim 64, 128 or 256 (d a multiple of 16), 16-byte "
            "aligned rows; dequantize the cache for other shapes")
    o, o4, direct, lse3 = _forward_outputs(p, out, odt)
    q4 = to_bhsd(q, p, p.hq, p.nq)
    if p.nq and p.batch and p.hq:
        kv_descales = fp8_checks.descale_operands(kd, vd, p.batch, p.hkv, cupy.cuda.Device().id)
        cuda.decode(p, q4, k4, v4, o4, lse3, kv_lens=lens_dev, paged=paged, kv_descales=kv_descales)
    return _forward_result(p, o, o4, direct, lse3, return_lse)


@interop.accepts_foreign_arrays("q", "k", "v", "kv_lens", "cu_seqlens_q", "cu_seqlens_k", "block_table",
                                "alibi_slopes", "sinks", outputs=("out",))
def _attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, out=None,
               kv_lens=None, validate=True, window=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
               softcap=None, alibi_slopes=None, sinks=None, out_dtype=None, max_seqlen_q=None, max_seqlen_k=None):
    """attention without a plan: validate, convert foreign arrays (cuflash.api.interop), plan, run."""
    _problem.check_flag("return_lse", return_lse)
    _problem.check_flag("validate", validate)
    max_seqlens = _problem.check_max_seqlens(max_seqlen_q, max_seqlen_k,
                                             packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    mods = (softcap, alibi_slopes, sinks)
    if out_dtype is not None and np.dtype(q.dtype) == FLOAT32:
        out_dtype = None
    if out_dtype is not None and array_namespace(q) is not np:
        if q.ndim >= 2 and (q.shape[-1], v.shape[-1]) == _problem.MLA_HEAD_DIMS:
            raise NotImplementedError("out_dtype: MLA decode (head dims 576 / 512) on the GPU gives o in q's dtype")
        if block_table is None and cu_seqlens_q is None and cu_seqlens_k is None and kv_lens is None \
                and window is None and all(m is None for m in mods):
            # Plain shapes: the 16-bit mma.sync kernel with a float32 epilogue, where it applies.
            p = _problem.validate_forward(q, k, v, causal=causal, scale=scale, layout=layout)
            _problem.check_out("out", out, p.o_shape(), FLOAT32, p.xp, (("q", q), ("k", k), ("v", v)))
            o, o4, direct, lse3 = _forward_outputs(p, out, FLOAT32)
            q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk, p.dv)
            if p.dv == p.d and cuda.forward_o32(p, q4, k4, v4, o4, lse3):
                return _forward_result(p, o, o4, direct, lse3, return_lse)
        # Elsewhere the GPU's 16-bit kernels store 16-bit o: widen the inputs (exact) and run the
        # float32 kernels, which compute in float64 and round o once to float32 (score modifiers,
        # windows and packed sequences then raise NotImplementedError as for float32 inputs).
        options = dict(causal=causal, scale=scale, layout=layout, window=window)
        if block_table is not None:
            _problem.validate_paged(q, k, v, block_table, **options)
        elif cu_seqlens_q is None and cu_seqlens_k is None:
            _problem.validate_forward(q, k, v, **options)
        q, k, v = (widen_to_float32(a) for a in (q, k, v))
        out_dtype = None
    if block_table is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("block_table: not combinable with cu_seqlens_q / cu_seqlens_k")
        return _attention_paged(q, k, v, block_table, kv_lens, causal=causal, scale=scale, layout=layout,
                                window=window, return_lse=return_lse, out=out, validate=validate, mods=mods,
                                out_dtype=out_dtype)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, layout=layout,
                                 window=window, kv_lens=kv_lens, return_lse=return_lse, out=out, mods=mods,
                                 out_dtype=out_dtype, max_seqlens=max_seqlens, validate=validate)
    p = _problem.validate_forward(q, k, v, causal=causal, scale=scale, layout=layout, window=window)
    p = _problem.check_score_mods(p, q, *mods)
    odt = p.dtype if out_dtype is None else FLOAT32
    _problem.check_out("out", out, p.o_shape(), odt, p.xp, (("q", q), ("k", k), ("v", v)))
    o, o4, direct, lse3 = _forward_outputs(p, out, odt)
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk, p.dv)
    lens_dev, lens_host = _problem.check_kv_lens(kv_lens, p, validate)
    if lens_dev is None:
        _backend(p).forward(p, q4, k4, v4, o4, lse3)
    else:
        _forward_with_lengths(p, q4, k4, v4, o4, lse3, lens_dev, lens_host)
    return _forward_result(p, o, o4, direct, lse3, return_lse)


def _forward_outputs(p, out, odt):
    """(o, o4, direct, lse3): o (out or fresh), its (B, Hq, Nq, d) view o4 - a scratch array when
    out's strides don't merge into one batch axis or its head dim is strided, which the kernels
    do not write (direct False: copied in by _forward_result)."""
    xp = p.xp
    if xp is not np:
        _problem.warn_if_capture_unsafe()
    o = out if out is not None else xp.empty(p.o_shape(), dtype=odt)
    o4 = to_bhsd(o, p, p.hq, p.nq, p.dv)
    direct = is_view_of(o4, o) and (p.dv == 1 or o4.strides[-1] == o4.itemsize)
    if not direct:
        o4 = xp.empty((p.batch, p.hq, p.nq, p.dv), dtype=odt)
    return o, o4, direct, xp.empty((p.batch, p.hq, p.nq), dtype=np.float32)


def _forward_result(p, o, o4, direct, lse3, return_lse):
    if not direct:
        o[...] = from_bhsd(o4, p, p.hq, p.nq)
    if return_lse:
        return o, lse3.reshape(p.lse_shape())
    return o


def _attention_paged(q, k_cache, v_cache, block_table, kv_lens, *, return_lse, out, validate, mods, out_dtype,
                     **options):
    """Paged KV cache: the decode kernel reads pages in place (a window's too); otherwise (NumPy,
    prefill shapes) each sequence's used pages are gathered into a contiguous (1, Hkv, kv_len, d)
    copy, its window aligned on its own kv_len keys."""
    p, bs = _problem.validate_paged(q, k_cache, v_cache, block_table, **options)
    p = _problem.check_score_mods(p, q, *mods)
    odt = p.dtype if out_dtype is None else FLOAT32
    _problem.check_out("out", out, p.o_shape(), odt, p.xp, (("q", q), ("k", k_cache), ("v", v_cache)))
    xp = p.xp
    lens_dev, lens_host = _problem.check_kv_lens(kv_lens, p, validate)
    if lens_dev is None:  # every sequence holds Nk keys: the decode kernel needs no lengths array
        lens_host = np.full(p.batch, p.nk, dtype=np.int64)
    table_host = None
    if validate or xp is np:
        table_host = _problem.check_block_table(block_table, lens_host, bs, k_cache.shape[0])
    o, o4, direct, lse3 = _forward_outputs(p, out, odt)
    q4 = to_bhsd(q, p, p.hq, p.nq)
    done = False
    if xp is not np:
        if cuda.decode_applies(p, k_cache, v_cache):
            table = xp.ascontiguousarray(block_table)
            cuda.decode(p, q4, k_cache, v_cache, o4, lse3, kv_lens=lens_dev, paged=(table, bs))
            done = True
    if not done:
        why = "outside decode shapes each sequence's pages are gathered on the host, which cannot be captured"
        if lens_host is None:
            lens_host = _problem.to_host(lens_dev, "kv_lens", why).astype(np.int64)
        if table_host is None:
            table_host = np.asarray(_problem.to_host(block_table, "block_table", why)).astype(np.int64)
        for b, n in enumerate(lens_host):
            n = int(n)
            pages = xp.asarray(table_host[b, : -(-n // bs)])
            k4, v4 = (xp.ascontiguousarray(c[pages].reshape(-1, p.hkv, c.shape[-1])[:n].transpose(1, 0, 2))[None]
                      for c in (k_cache, v_cache))
            pb = p.sequence(b, batch_shape=(1,), nk=n)
            sl = slice(b, b + 1)
            _backend(p).forward(pb, q4[sl], k4, v4, o4[sl], lse3[sl])
    return _forward_result(p, o, o4, direct, lse3, return_lse)


def _forward_with_lengths(p, q4, k4, v4, o4, lse3, lens_dev, lens_host):
    """kv_lens: the decode kernel reads them on the device; otherwise each sequence is its own
    problem over the first kv_lens[b] keys (the readable specification, also the CPU path)."""
    if p.xp is not np and cuda.decode_applies(p, k4, v4) and (p.dv == p.d or _problem.is_mla(p)):
        cuda.decode(p, q4, k4, v4, o4, lse3, kv_lens=lens_dev)
        return
    backend = _backend(p)
    _each_sequence_over_its_keys(p, q4, k4, v4, o4, lse3, lens_dev, lens_host,
                                 lambda pb, b, *views: backend.forward(pb, *views))


def _each_sequence_over_its_keys(p, q4, k4, v4, o4, lse3, lens_dev, lens_host, run):
    """Each batch entry b as its own problem over its first kv_lens[b] keys: run(pb, b, q, k, v, o,
    lse) with that entry's views. kv_lens is read on the host where only the device holds it (one
    copy, not capturable in a CUDA graph)."""
    if lens_host is None:
        lens_host = _problem.to_host(lens_dev, "kv_lens", "outside decode shapes each sequence runs as its own "
                                     "problem sized on the host, which cannot be captured").astype(np.int64)
    for b, n in enumerate(np.clip(lens_host, 0, p.nk).tolist()):
        pb = p.sequence(b, batch_shape=(1,), nk=int(n), single_head=False)
        sl = slice(b, b + 1)
        run(pb, b, q4[sl], k4[sl, :, :n], v4[sl, :, :n], o4[sl], lse3[sl])


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, kv_lens, return_lse, out, mods, out_dtype, max_seqlens,
                      validate, **options):
    """Packed sequences (cu_seqlens_*): on the GPU one launch over all sequences; on the CPU each
    one is its own problem over its slices of q, k, v."""
    p, spans = _problem.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_lens=kv_lens, max_seqlens=max_seqlens,
                                        validate=validate, **options)
    p = _problem.check_score_mods(p, q, *mods, sequences=cu_seqlens_q.shape[0] - 1)
    odt = p.dtype if out_dtype is None else FLOAT32
    _problem.check_out("out", out, p.o_shape(), odt, p.xp, (("q", q), ("k", k), ("v", v)))
    o = out if out is not None else p.xp.empty(p.o_shape(), dtype=odt)
    lse = p.xp.empty(p.lse_shape(), dtype=np.float32)
    if p.xp is not np:
        _packed_on_gpu(p, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, spans, max_seqlens, cuda.forward_band)
        return (o, lse) if return_lse else o
    for pb, qs, ks in _problem.sequences(p, spans):
        q4, o4 = _sequence_views(pb, qs, "q", q, o)
        k4, v4 = _sequence_views(pb, ks, "k", k, v)
        _backend(p).forward(pb, q4, k4, v4, o4, lse[None, :, qs])
    return (o, lse) if return_lse else o


def _packed_on_gpu(p, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, spans, max_seqlens, forward):
    """One launch over all packed sequences: forward(p, q4, k4, v4, o4, lse3, cu_seqlens=,
    max_seqlen_q=) on (1, H, total, d) views, o copied in where out='s strides allow no view.
    ``spans``: core.problem.validate_varlen's (None: offsets not read); ``max_seqlens``: the caller's."""
    cu = _packed_offsets(p, cu_seqlens_q, cu_seqlens_k, spans)
    longest = _problem.longest_sequences(spans, max_seqlens)
    (o4,), direct = _packed_outputs(p, (o,), ((p.hq, p.nq),))
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    forward(p, q4, k4, v4, o4, lse[None], cu_seqlens=cu, max_seqlen_q=longest[0])
    if not direct[0]:
        o[...] = from_bhsd(o4, p, p.hq, p.nq)


def _packed_offsets(p, cu_seqlens_q, cu_seqlens_k, spans):
    """(cu_q, cu_k) contiguous on the device. Offsets the host has not read (spans None) are
    clamped into the packed arrays on the device first (cuda.clamp_packed_offsets), so that the
    kernels, which trust their offsets, never address rows outside them."""
    import cupy

    cu = cupy.ascontiguousarray(cu_seqlens_q), cupy.ascontiguousarray(cu_seqlens_k)
    return cu if spans is not None else cuda.clamp_packed_offsets(*cu, p.nq, p.nk)


def _packed_outputs(p, arrays, rows):
    """(1, H, total, d) views of packed outputs, or scratch arrays where out='s strides do not
    allow a view with a unit head-dim stride (the caller copies those in afterwards)."""
    views, direct = [], []
    for a, (h, n) in zip(arrays, rows):
        a4 = to_bhsd(a, p, h, n)
        ok = is_view_of(a4, a) and (a4.shape[-1] == 1 or a4.strides[-1] == a4.itemsize)
        views.append(a4 if ok else p.xp.empty((1, h, n, a4.shape[-1]), dtype=a.dtype))
        direct.append(ok)
    return views, direct


def _sequence_views(pb, rows, side, *arrays):
    """(1, H, n, d) views of one packed sequence's rows of (total, H, d) arrays."""
    heads, n = (pb.hq, pb.nq) if side == "q" else (pb.hkv, pb.nk)
    return [to_bhsd(a[rows], pb, heads, n) for a in arrays]


@interop.accepts_foreign_arrays("do", "q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
                                "sinks", outputs=("out",))
def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, layout="bhsd", deterministic=False,
                       out=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, softcap=None, alibi_slopes=None,
                       sinks=None, max_seqlen_q=None, max_seqlen_k=None, validate=True):
    """Gradients (dq, dk, dv) of ``attention`` for upstream gradient ``do``.

    ``o`` and ``lse`` are the forward's outputs (``return_lse=True``); P is recomputed tile by
    tile from q, k and lse, and D = rowsum(do * o). dk and dv are summed over the query heads
    that share a K/V head. ``deterministic=True`` asks for bitwise-reproducible dq.
    ``out`` : optional tuple (dq, dk, dv) of arrays to write the gradients into (shapes of q, k,
    k; q's dtype; overlapping neither the inputs nor each other).
    ``window``, ``cu_seqlens_q``, ``cu_seqlens_k`` : as for :func:`attention` (packed do, o like
    q and lse (Hq, total_q)); on the GPU the mma.sync band kernels (float16/bfloat16).
    ``max_seqlen_q``, ``max_seqlen_k``, ``validate`` : as for :func:`attention`'s packed
    sequences (with both lengths, validate=False and device offsets no offset is read on the host).

    float32 on the GPU computes in float64 and rounds once; it recomputes each row's log-sum-exp
    and D itself (so ``o`` and ``lse`` are checked but not read), needs no atomics (always
    reproducible), and raises NotImplementedError for ``window`` / ``cu_seqlens_*``.

    ``softcap``, ``alibi_slopes``, ``sinks``: as given to the forward (``lse`` then includes the
    sink). The softcap's derivative 1 - tanh^2(s / softcap) enters dS; the ALiBi slopes get no
    gradient. With ``sinks`` the result is (dq, dk, dv, dsinks): dsinks float32 (Hq,),
    dsinks_h = -sum over the rows of head h (all batch entries) of P_sink * rowsum(do * o), with
    P_sink = exp(sinks[h] - lse); ``out`` stays a triple (dsinks is always a fresh array).
    """
    mods = (softcap, alibi_slopes, sinks)
    max_seqlens = _problem.check_max_seqlens(max_seqlen_q, max_seqlen_k,
                                             packed=cu_seqlens_q is not None or cu_seqlens_k is not None)
    _problem.check_flag("validate", validate)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale,
                                layout=layout, window=window, deterministic=deterministic, out=out, mods=mods,
                                max_seqlens=max_seqlens, validate=validate)
    p = _problem.validate_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout, window=window)
    p = _problem.check_score_mods(p, q, *mods)
    _problem.check_flag("deterministic", deterministic)
    xp = p.xp
    rows = ((p.hq, p.nq, p.d), (p.hkv, p.nk, p.d), (p.hkv, p.nk, p.dv))
    dq, dk, dv = _gradient_outputs(p, out, (("do", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)))
    do4, o4 = (to_bhsd(a, p, p.hq, p.nq, p.dv) for a in (do, o))
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk, p.dv)
    lse3 = lse.reshape((p.batch, p.hq, p.nq))
    grads = [to_bhsd(g, p, h, n, d) for g, (h, n, d) in zip((dq, dk, dv), rows)]
    # An out= array whose strides do not merge into (B, H, N, d) with a unit head-dim stride gets
    # a scratch array; the result is copied in afterwards.
    direct = [is_view_of(g4, g) and (g4.shape[-1] == 1 or g4.strides[-1] == g4.itemsize)
              for g4, g in zip(grads, (dq, dk, dv))]
    grads = [g4 if ok else xp.empty((p.batch, h, n, d), dtype=p.dtype)
             for g4, ok, (h, n, d) in zip(grads, direct, rows)]
    dsinks = _dsinks(p)
    _backend(p).backward(p, do4, q4, k4, v4, o4, lse3, *grads, deterministic=bool(deterministic), **dsinks)
    for g, g4, ok, (h, n, _) in zip((dq, dk, dv), grads, direct, rows):
        if not ok:
            g[...] = from_bhsd(g4, p, h, n)
    return (dq, dk, dv) + tuple(dsinks.values())


def _dsinks(p):
    """{"dsinks": a zeroed float32 (Hq,) accumulator} with sinks, else {} (backends add into it)."""
    return {} if p.sinks is None else {"dsinks": p.xp.zeros(p.hq, dtype=np.float32)}


def _backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, deterministic, out, mods, max_seqlens,
                     validate, **options):
    """Packed sequences: each sequence's gradients from its own slices (dk, dv rows of a sequence
    are written by that sequence only, so every row is written once)."""
    p, spans = _problem.validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, grads=(do, o, lse),
                                        max_seqlens=max_seqlens, validate=validate, **options)
    p = _problem.check_score_mods(p, q, *mods, sequences=cu_seqlens_q.shape[0] - 1)
    _problem.check_flag("deterministic", deterministic)
    dq, dk, dv = _gradient_outputs(p, out, (("do", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse)))
    dsinks = _dsinks(p)
    if p.xp is not np:  # one launch per kernel over all sequences
        cu = _packed_offsets(p, cu_seqlens_q, cu_seqlens_k, spans)
        longest = _problem.longest_sequences(spans, max_seqlens)
        rows = ((p.hq, p.nq), (p.hkv, p.nk), (p.hkv, p.nk))
        grads, direct = _packed_outputs(p, (dq, dk, dv), rows)
        do4, q4, o4 = (to_bhsd(a, p, p.hq, p.nq) for a in (do, q, o))
        k4, v4 = (to_bhsd(a, p, p.hkv, p.nk) for a in (k, v))
        _backend(p).backward(p, do4, q4, k4, v4, o4, lse[None], *grads, deterministic=bool(deterministic),
                             cu_seqlens=cu, max_seqlens=longest, **dsinks)
        for g, g4, ok, (h, n) in zip((dq, dk, dv), grads, direct, rows):
            if not ok:
                g[...] = from_bhsd(g4, p, h, n)
        return (dq, dk, dv) + tuple(dsinks.values())
    for pb, qs, ks in _problem.sequences(p, spans):
        do4, q4, o4, dq4 = _sequence_views(pb, qs, "q", do, q, o, dq)
        k4, v4, dk4, dv4 = _sequence_views(pb, ks, "k", k, v, dk, dv)
        _backend(p).backward(pb, do4, q4, k4, v4, o4, lse[None, :, qs], dq4, dk4, dv4,
                             deterministic=bool(deterministic), **dsinks)
    return (dq, dk, dv) + tuple(dsinks.values())


def _gradient_outputs(p, out, inputs):
    """(dq, dk, dv): fresh arrays, or the checked arrays of ``out=(dq, dk, dv)``."""
    xp = p.xp
    if xp is not np:
        _problem.warn_if_capture_unsafe()
    if out is None:
        return (xp.empty(p.q_shape(), dtype=p.dtype), xp.empty(p.kv_shape(), dtype=p.dtype),
                xp.empty(p.v_shape(), dtype=p.dtype))
    if not (isinstance(out, tuple) and len(out) == 3) or any(a is None for a in out):
        got = (f"a tuple of {len(out)}" + (" with None in it" if len(out) == 3 else "")) if isinstance(out, tuple) \
            else type(out).__name__
        raise TypeError(f"out: expected a tuple (dq, dk, dv) of arrays, got {got}")
    names = ("out[0]", "out[1]", "out[2]")
    for name, a, shape in zip(names, out, (p.q_shape(), p.kv_shape(), p.v_shape())):
        _problem.check_out(name, a, shape, p.dtype, xp, inputs)
    for i in range(3):
        for j in range(i):
            if may_share_memory(out[i], out[j]):
                raise ValueError(f"{names[i]}: must not overlap {names[j]}")
    return out


def attention_vjp(q, k, v, *, causal=False, scale=None, layout="bhsd", window=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, softcap=None, alibi_slopes=None, sinks=None, max_seqlen_q=None,
                  max_seqlen_k=None, validate=True):
    """Forward once and return ``(o, vjp)``; ``vjp(do)`` gives (dq, dk, dv) from the saved o, lse
    ((dq, dk, dv, dsinks) with ``sinks``)."""
    masking = dict(window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   validate=validate)
    o, lse = attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True, **masking)

    def vjp(do, *, deterministic=False):
        return attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout,
                                  deterministic=deterministic, **masking)

    return o, vjp


def prepare_attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, kv_lens=None,
                      block_table=None, window=None, validate=True, softcap=None, alibi_slopes=None, sinks=None,
                      k_descale=None, v_descale=None):
    """A callable ``run(q, k, v, *, kv_lens=None, block_table=None, out=None, k_descale=None,
    v_descale=None)`` equal to ``cuflash.attention(q, k, v, causal=..., ..., kv_lens=kv_lens,
    block_table=block_table, out=out, k_descale=k_descale, v_descale=v_descale)`` for arrays of
    the geometry given here (same kinds, device, shapes, strides, dtypes; kv_lens / block_table /
    k_descale / v_descale given iff given here). The arguments are checked here as attention
    checks them; the example arrays' values are not read (but kv_lens' and block_table's with
    validate=True, and NumPy descales', as attention would).

    ``validate`` applies to every call: True copies kv_lens / block_table to the host each call
    to check their values (as attention does); False skips that (out-of-range kv_lens are clamped
    by the decode kernel; block_table entries are trusted), and a call then needs no host read:
    it can be captured in a CUDA graph. A call's ``out`` must be an array like the result (q's
    shape, dtype, kind and device, C-contiguous) that overlaps no input.

    The returned object's ``path`` says how calls run: "decode" (validated once, the decode kernel
    launched from a packed parameter block) or "attention" (cuflash.attention per call).

    ``softcap``, ``alibi_slopes``, ``sinks``: as for attention, fixed at preparation (the arrays
    are kept and read by every call); such a problem runs the "attention" path.

    ``k_descale``, ``v_descale``: an FP8 KV cache (a float16/bfloat16 q with e4m3 k and v), as for
    attention; each call passes its own descales, of the geometry given here (their values may
    change). On the GPU its decode shapes run the "decode" path (attn_decode_kv8) with descales per
    tensor, or per (sequence, K/V head) stored in C order (read in place; other strides, or one
    per-tensor factor beside a per-head one, run the "attention" path, where attention copies
    them). NumPy arrays run the "attention" path. FP8 inputs other than a KV cache (an e4m3 q)
    raise NotImplementedError: call attention for those."""
    mods = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return PreparedAttention(q, k, v, dict(causal=causal, scale=scale, layout=layout, return_lse=return_lse,
                                           window=window, validate=validate, **mods), kv_lens, block_table,
                             fallback=attention, descales=(k_descale, v_descale))
