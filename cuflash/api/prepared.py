"""Prepared attention: validate and plan once for a geometry, then call it many times.

A decoding loop calls attention with the same shapes, strides and dtypes on every token; only
the data (and the lengths in kv_lens) change. ``cuflash.attention`` re-validates and re-plans
each call, and CuPy converts every kernel argument on every launch: about 90 us of host time per
decode call on the H200 machine, more than the kernel itself on a 4k cache
(tools/decode_host_parts.py measures it). ``prepare_attention`` does that work once, like a cuDNN graph or
FlashInfer's plan/run: a call then checks that its arrays have the prepared geometry, allocates
the outputs and launches the decode kernel through a packed parameter block (cuflash.kernels.packed_launch).

What a call may change: the arrays' data (their addresses), the values of kv_lens, block_table
and an FP8 KV cache's k_descale / v_descale. What it may not: kinds (CuPy, torch, ...), device,
shapes, strides, dtypes, which of kv_lens / block_table / k_descale / v_descale are given - a
call that differs raises ValueError naming the argument.

The fast path covers what runs the split-KV decode kernel from CuPy arrays or CUDA torch tensors
with few query rows per K/V head: float16/bfloat16 caches (plan.dispatch.decode_applies) and
e4m3 caches with a float16/bfloat16 q (attn_decode_kv8, plan.dispatch.decode_applies_e4m3; its
descales per tensor, or per (sequence, K/V head) stored in C order, both read in place). Every
other prepared problem (NumPy, prefill shapes, other array kinds, descales attention copies
first) calls ``cuflash.attention`` with the prepared options after the same geometry check, so
results never depend on which path ran. Results are bitwise those of ``cuflash.attention`` on the
same inputs (tests/test_gpu_prepared.py, tests/test_gpu_prepared_fp8_cache.py).
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..core import fp8_inputs
from ..core import problem as _problem
from . import fp8_checks, interop
from ..backends import cuda
from ..kernels import counters as stream_counters
from ..kernels import decode as decode_kernels
from ..plan import decode as decode_plan
from ..kernels import pdl
from ..kernels.build import get_function
from ..kernels.packed_launch import POINTER, PackedLaunch
from ..core.arrays import FLOAT32, byte_range, dtype_name
from ..core.layout import is_view_of, to_bhsd

_ARRAYS = ("q", "k", "v", "kv_lens", "block_table")
_DESCALES = ("k_descale", "v_descale")  # an FP8 KV cache's (its q takes none)
_GIVEN = _ARRAYS + _DESCALES  # the arguments whose geometry a call must repeat


def _geometry(kind, a):
    """What must stay fixed for one array between prepare and call (None: not given)."""
    if a is None:
        return None
    try:
        if kind == interop.TORCH:
            return ("torch", type(a), tuple(a.shape), a.stride(), a.dtype, a.device)
        if kind == interop.CUPY:
            return ("cupy", type(a), a.shape, a.strides, a.dtype, a.data.device_id)
        if kind == interop.NUMPY:
            return ("numpy", type(a), a.shape, a.strides, a.dtype)
    except AttributeError:  # an array of another kind than prepared: it cannot match
        pass
    return ("other", type(a), tuple(getattr(a, "shape", ())), getattr(a, "dtype", None))


def _describe(g) -> str:
    if g is None:
        return "not given"
    if g[0] == "torch":
        return f"torch shape {g[2]} strides {g[3]} {g[4]} on {g[5]}"
    if g[0] == "cupy":
        return f"cupy shape {g[2]} strides {g[3]} (bytes) {dtype_name(g[4])} on cuda:{g[5]}"
    if g[0] == "numpy":
        return f"numpy shape {g[2]} strides {g[3]} (bytes) {dtype_name(g[4])}"
    return f"{g[1].__name__} shape {g[2]} dtype {g[3]}"


class PreparedAttention:
    """See :func:`prepare_attention`."""

    def __init__(self, q, k, v, options, kv_lens, block_table, fallback=None, descales=(None, None)):
        """``fallback(q, k, v, *, kv_lens, block_table, out, k_descale, v_descale, **options)``: what
        a call off the decode fast path runs (cuflash.attention; None: such a call raises).
        ``descales``: (k_descale, v_descale) of an FP8 KV cache."""
        _problem.check_flag("return_lse", options["return_lse"])
        _problem.check_flag("validate", options["validate"])
        given = dict(q=q, k=k, v=v, kv_lens=kv_lens, block_table=block_table, k_descale=descales[0],
                     v_descale=descales[1])
        where = interop.common_placement([(n, a) for n, a in given.items() if a is not None])
        self._kind = where.kind
        self._geometry = {n: _geometry(self._kind, a) for n, a in given.items()}
        self._options = options
        self._fallback = fallback
        fp8 = fp8_inputs.requested((q, k, v), (None, *descales))  # (as cuflash.attention tells FP8 calls)
        with interop.ForeignCall(where) as call:
            checked = _Checked(call, given, options, fp8)
            self._decode = None
            if self._kind in (interop.CUPY, interop.TORCH) and where.device is not None:
                self._decode = _DecodeCall.prepare(where, checked, options, q)
        self.path = "attention" if self._decode is None else "decode"
        self.kernel = None if self._decode is None else self._decode.kernel_names

    def _check_call(self, arrays):
        for name in _GIVEN:
            got = _geometry(self._kind, arrays[name])
            want = self._geometry[name]
            if got != want:
                raise ValueError(f"{name}: prepared for {_describe(want)}, got {_describe(got)}; "
                                 "prepare_attention again for another geometry")

    def __call__(self, q, k, v, *, kv_lens=None, block_table=None, out=None, k_descale=None, v_descale=None):
        arrays = dict(q=q, k=k, v=v, kv_lens=kv_lens, block_table=block_table, k_descale=k_descale,
                      v_descale=v_descale)
        self._check_call(arrays)
        if self._decode is not None:
            result = self._decode(arrays, out)
            if result is not None:
                return result
        if self._fallback is None:
            raise ValueError("this prepared call runs the decode kernel only; these arrays do not")
        return self._fallback(q, k, v, kv_lens=kv_lens, block_table=block_table, out=out, k_descale=k_descale,
                              v_descale=v_descale, **self._options)

    def __repr__(self):
        return f"PreparedAttention(path={self.path!r}, kernel={self.kernel!r})"


class _Checked:
    """The arguments as NumPy/CuPy arrays, checked as cuflash.attention checks them: the problem,
    the paged cache's block size, kv_lens on the device and (validate=True) on the host; with
    ``fp8`` (FP8 inputs or descales, as attention tells them) as an FP8 KV cache, the descales
    checked (``kv8``: the cache on the GPU, for the decode kernel's e4m3 form)."""

    def __init__(self, call, given, options, fp8=False):
        # (torch float8_e4m3fn tensors travel as their uint8 bits, as attention passes them)
        self.native = {n: (None if a is None else call.to_native(n, fp8_inputs.as_bits(a))) for n, a in given.items()}
        q, k, v, lens, table = (self.native[n] for n in _ARRAYS)
        masking = {n: options[n] for n in ("causal", "scale", "layout", "window")}
        mods = [None if options.get(n) is None else call.to_native(n, options[n]) for n in ("alibi_slopes", "sinks")]
        self.kv8, self.descales = False, None
        if fp8:
            self.p, self.block_size = self._fp8_cache(call, options)
        elif table is not None:
            self.p, self.block_size = _problem.validate_paged(q, k, v, table, **masking)
        else:
            self.p, self.block_size = _problem.validate_forward(q, k, v, **masking), None
        if not self.kv8:  # (an e4m3 cache on the GPU refused score modifiers)
            self.p = _problem.check_score_mods(self.p, q, options.get("softcap"), *mods)
        self.lens_dev = _check_lens_and_table(self.p, lens, table, self.block_size, k.shape[0], options["validate"])

    def _fp8_cache(self, call, options):
        """(problem, block size) of an FP8 call, checked as attention checks it (core.fp8_inputs,
        api.fp8_checks), up to out= and the values of kv_lens / block_table. Prepared calls take FP8
        inputs as an FP8 KV cache only (a 16-bit q, e4m3 k and v): another valid FP8 call raises
        NotImplementedError."""
        q, k, v, table = (self.native[n] for n in ("q", "k", "v", "block_table"))
        descales = (None, self.native["k_descale"], self.native["v_descale"])
        layout = options["layout"]
        if all(isinstance(a, np.ndarray) for a in (q, k, v)):  # the NumPy backend
            if call.placement.kind != interop.NUMPY:  # (torch CPU tensors: their bits as NumPy e4m3)
                q, k, v = (a.view(fp8_inputs.E4M3) if a.dtype == np.uint8 else a for a in (q, k, v))
                self.native.update(q=q, k=k, v=v)
            fp8_checks.check_host((q, k, v), descales, None, layout, table is None)
            _cache_only((q, k, v))
            # attention computes from float32 copies (dequantized k and v): checked as such
            wide = [np.lib.stride_tricks.as_strided(np.zeros((), FLOAT32), a.shape, (0,) * a.ndim) for a in (q, k, v)]
            masking = {n: options[n] for n in ("causal", "scale", "layout", "window")}
            if table is not None:
                return _problem.validate_paged(*wide, table, **masking)
            return _problem.validate_forward(*wide, **masking), None
        if not fp8_inputs.kv_cache_only((q, k, v)):
            fp8_inputs.check_gpu_call((q, k, v), None)  # (TypeError naming an input that holds no e4m3 bits)
            _cache_only((q, k, v))
        p, bs, kd, vd = fp8_checks.check_gpu_cache(q, k, v, descales, None, dict(options, block_table=table))
        self.kv8 = True
        self.descales = (kd, vd)
        return p, bs


def _cache_only(arrays):
    """NotImplementedError for FP8 inputs other than an FP8 KV cache (prepared calls take no e4m3 q)."""
    if not fp8_inputs.kv_cache_only(arrays):
        raise NotImplementedError("q: prepare_attention takes FP8 inputs as an FP8 KV cache only (a float16/bfloat16 "
                                  "q with e4m3 k and v); call cuflash.attention for an e4m3 q")


def _check_lens_and_table(p, lens, table, block_size, num_blocks, validate):
    """kv_lens (and, with validate=True, its values and the pages they use, on the host) as
    cuflash.attention checks them; returns kv_lens as the kernel reads it."""
    lens_dev, lens_host = _problem.check_kv_lens(lens, p, validate)
    if table is not None and validate:
        if lens_host is None:  # every sequence holds Nk keys
            lens_host = np.full(p.batch, p.nk, dtype=np.int64)
        _problem.check_block_table(table, lens_host, block_size, num_blocks)
    return lens_dev


class _CupyArrays:
    """Per-call array operations of the decode fast path for CuPy arrays."""

    def __init__(self, device):
        import cupy

        self.cupy = cupy
        self.device = device

    def on_device(self) -> bool:
        return self.cupy.cuda.runtime.getDevice() == self.device

    def device_context(self):
        return self.cupy.cuda.Device(self.device)

    def stream(self) -> int:
        _problem.warn_if_capture_unsafe(stacklevel=6)  # the buffers allocated below, under capture
        return self.cupy.cuda.get_current_stream().ptr

    @staticmethod
    def capturing() -> bool:
        return _problem.stream_is_capturing()

    def empty(self, shape, like=None):
        return self.cupy.empty(shape, dtype=np.float32 if like is None else like.dtype)

    def fresh_geometry(self, shape, like):
        """_geometry of empty(shape, like), without allocating (a view over like's memory)."""
        return _geometry(interop.CUPY, self.cupy.ndarray(shape, dtype=like.dtype, memptr=like.data))

    @staticmethod
    def ptr(a) -> int:
        return a.data.ptr

    @staticmethod
    def native(a):
        return a

    @staticmethod
    def checking():
        """Where kv_lens / block_table values are read on the host: CuPy's current stream as is."""
        return contextlib.nullcontext()

    def explain_out(self, out, shape, dtype, inputs):
        """Raise the error for an out= that is not like a fresh result (cuflash.attention's checks)."""
        _problem.check_out("out", out, shape, dtype, self.cupy, inputs)
        raise ValueError(f"out: expected a C-contiguous array on cuda:{self.device} (a prepared call's result layout)")


class _TorchArrays:
    """Per-call array operations of the decode fast path for CUDA torch tensors (torch's
    allocator and current stream, as cuflash.api.interop runs torch calls)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device

    def on_device(self) -> bool:
        return self.torch.cuda.current_device() == self.device

    def device_context(self):
        return self.torch.cuda.device(self.device)

    def stream(self) -> int:
        return self.torch.cuda.current_stream(self.device).cuda_stream

    def capturing(self) -> bool:
        return self.torch.cuda.is_current_stream_capturing()

    def empty(self, shape, like=None):
        dtype = self.torch.float32 if like is None else like.dtype
        return self.torch.empty(shape, dtype=dtype, device=f"cuda:{self.device}")

    def fresh_geometry(self, shape, like):
        """_geometry of empty(shape, like), without allocating (a meta tensor's strides)."""
        meta = self.torch.empty(shape, dtype=like.dtype, device="meta")
        return _geometry(interop.TORCH, meta)[:5] + (self.torch.device("cuda", self.device),)

    @staticmethod
    def ptr(a) -> int:
        return a.data_ptr()

    @staticmethod
    def native(a):
        return interop._import_torch(a)

    def checking(self):
        """Where kv_lens / block_table values are read on the host: the tensors' device, with
        torch's current stream as CuPy's, so the read follows the tensors' pending writes (the
        views of interop._import_torch carry no DLPack stream handshake)."""
        import cupy

        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(self.device))
        stack.enter_context(interop.external_stream(self.stream(), self.device))
        return stack

    def explain_out(self, out, shape, dtype, inputs):
        """Raise the error for an out= that is not like a fresh result."""
        torch = self.torch
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor like the inputs, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
        if out.dtype != dtype:
            raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
        raise ValueError(f"out: expected a contiguous tensor on cuda:{self.device} (a prepared call's result layout)")


def _descale_slots(checked, p, dev):
    """(k address, v address, batch stride, head stride) of an e4m3 cache's descales in a prepared
    launch: an address is None where the call's own descale is read in place, or the constant
    address of the unit descale that a missing one stands for. None where attention reads a copy
    (fp8_checks.descale_operands: a per-tensor factor beside a per-head one, per-head factors not in
    C order): such calls take attention's path. (The geometry, fixed by prepare, decides which.)"""
    one = fp8_checks.unit_descale(dev)
    slots = []
    *operands, batch_stride, head_stride = fp8_checks.descale_operands(*checked.descales, p.batch, p.hkv, dev)
    for given, operand in zip(checked.descales, operands):
        base = one if given is None else given
        if operand.data.ptr != base.data.ptr:
            return None  # a copy
        slots.append(None if given is not None else one.data.ptr)
    return (*slots, batch_stride, head_stride)


class _DecodeCall:
    """The decode fast path of one prepared geometry: per call the outputs are allocated and the
    packed launches made; everything else was decided at prepare time."""

    @classmethod
    def prepare(cls, where, checked, options, q_given):
        """A _DecodeCall, or None when the prepared problem does not run the decode kernel on plain
        views of the caller's arrays (calls then go through cuflash.attention)."""
        import cupy

        p, bs = checked.p, checked.block_size
        q, k, v, lens, table = (checked.native[n] for n in _ARRAYS)
        if p.xp is np or p.nq == 0 or p.batch == 0 or p.hq == 0 or p.modified or p.dv != p.d:
            return None  # (v's head dim unlike q's: attention pads it)
        q4 = to_bhsd(q, p, p.hq, p.nq)
        k4, v4 = (k, v) if table is not None else (to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk))
        views = ((q4, q), (k4, k), (v4, v))
        if not all(is_view_of(a4, a) and (p.d == 1 or a4.strides[-1] == a4.itemsize) for a4, a in views):
            return None  # attention would copy an input first
        if checked.lens_dev is not None and checked.lens_dev.data.ptr != lens.data.ptr:
            return None  # a strided kv_lens: attention copies it
        if table is not None and not table.flags.c_contiguous:
            return None  # attention copies it
        if not (cuda.decode_applies_e4m3(p, k4, v4) if checked.kv8 else cuda.decode_applies(p, k4, v4)):
            return None  # (an e4m3 cache: attention raises NotImplementedError)
        dev = cupy.cuda.Device().id
        descales = None
        if checked.kv8:
            descales = _descale_slots(checked, p, dev)
            if descales is None:
                return None
        # A fresh result's layout, laid over q's memory (never read or written): preparing, which
        # cuflash.attention's plan cache does inside a call, allocates nothing.
        o_template = cupy.ndarray(p.q_shape(), dtype=p.dtype, memptr=q.data)
        o4 = to_bhsd(o_template, p, p.hq, p.nq)
        dl = decode_kernels.call_launch(p, dev, q4, k4, v4, o4, (table, bs) if table is not None else None,
                                        checked.kv8)
        offsets = tuple(a4.data.ptr - a.data.ptr for a4, a in views) + (o4.data.ptr - o_template.data.ptr,)
        extents = [tuple(x - a.data.ptr for x in byte_range(a)) for a in (q, k, v)]
        return cls(where, p, dl, bs, offsets, options, lens is not None, k.shape[0] if table is not None else None,
                   extents, q_given, descales)

    def __init__(self, where, p, dl, block_size, offsets, options, has_lens, num_blocks, extents, q_given,
                 descales=None):
        self.arrays = _TorchArrays(where.device) if where.kind == interop.TORCH else _CupyArrays(where.device)
        self.p = p
        self.block_size = block_size
        self.validate = options["validate"]
        self.return_lse = options["return_lse"]
        self.offsets = offsets  # where q4, k4, v4, o4 start relative to the arrays' own addresses
        self.workspace = dl.workspace_shapes()
        self.pairs = dl.problem.batch * dl.problem.hkv  # (sequence, K/V head, row block) blocks per split
        part = POINTER if self.workspace is not None else np.uint64(0)
        spec = dl.spec
        # Array slots in order: q, k, v, o, lse, [part_o, part_lse, split counters], [kv_lens], [block_table],
        # [k_descale, v_descale].
        self.num_blocks = num_blocks
        lens = POINTER if has_lens else np.uint64(0)
        table = POINTER if block_size is not None else np.uint64(0)
        # An e4m3 cache's descales: per slot the constant address of a unit descale, or None (the
        # call's own array, read in place); then the batch and head strides.
        self.descales = None if descales is None else descales[:2]
        kv_descales = None if descales is None else (POINTER, POINTER, *descales[2:])
        self.main = PackedLaunch(get_function(spec), dl.grid, (spec.threads,),
                                 dl.main_args(*(POINTER,) * 5, part, part, part, lens, table, kv_descales),
                                 spec.smem_bytes)
        self.combine = None
        # The partials merge in the last split of each pair, or in attn_decode_combine (decode_plan.MERGE).
        self.merge_last = decode_plan.last_split_merges(dl.plan, dl.rows, p.d)
        names = [spec.short_name]
        if self.workspace is not None and not self.merge_last:
            cspec = decode_plan.combine_spec(p.dtype, p.d)
            # A programmatic dependent where available (a packed launch costs no more host time that way).
            programmatic = decode_kernels.combine_programmatic(p, packed=True, splits=dl.plan.splits) and pdl.available()
            self.combine = PackedLaunch(get_function(cspec), dl.combine_grid(), (decode_plan._COMBINE_THREADS,),
                                        dl.combine_args(*(POINTER,) * 4), 0, programmatic)
            names.append(cspec.short_name)
        self.kernel_names = tuple(names)
        # out=: the geometry of a fresh result, and the byte extents (first, last + 1) of q, k, v
        # relative to their addresses, so that a call checks out= with a tuple compare and integers.
        self.kind = where.kind
        self.out_geometry = self.arrays.fresh_geometry(p.q_shape(), q_given)
        self.out_bytes = int(np.prod(p.q_shape())) * np.dtype(p.dtype).itemsize
        self.extents = extents

    def __call__(self, arrays, out):
        """The result, or None when this call cannot take the fast path (K/V rows not 16-byte
        aligned: attention then runs the prefill kernel)."""
        lib = self.arrays
        if not lib.on_device():
            with lib.device_context():
                return self(arrays, out)
        q, k, v, lens, table = (arrays[n] for n in _ARRAYS)
        _, ok, ov, oo = self.offsets
        if (lib.ptr(k) + ok) % 16 or (lib.ptr(v) + ov) % 16:
            return None
        p = self.p
        # In cuflash.attention's order: out=, the capture warning, then the values.
        if out is not None:
            self._check_out(out, (("q", q), ("k", k), ("v", v)))
        stream = lib.stream()
        if self.validate and (lens is not None or table is not None):
            with lib.checking():
                _check_lens_and_table(p, lib.native(lens) if lens is not None else None,
                                      lib.native(table) if table is not None else None, self.block_size,
                                      self.num_blocks, True)
        o = out if out is not None else lib.empty(p.q_shape(), like=q)
        lse = lib.empty((p.batch, p.hq, p.nq))
        o_ptr, lse_ptr = lib.ptr(o) + oo, lib.ptr(lse)
        ptrs = [lib.ptr(q) + self.offsets[0], lib.ptr(k) + ok, lib.ptr(v) + ov, o_ptr, lse_ptr]
        if self.workspace is not None:
            ws = [lib.empty(shape) for shape in self.workspace]
            ptrs += [lib.ptr(w) for w in ws]
            pairs = self.pairs
            if self.merge_last:  # (under capture a fresh buffer of the graph: cuflash.kernels.counters)
                ws.append(lib.empty((pairs,)) if lib.capturing() else None)
                ptrs.append(stream_counters.zeroed(pairs, stream, None if ws[-1] is None else lib.ptr(ws[-1])))
            else:
                ptrs.append(0)
        if lens is not None:
            ptrs.append(lib.ptr(lens))
        if table is not None:
            ptrs.append(lib.ptr(table))
        if self.descales is not None:
            ptrs += [lib.ptr(arrays[name]) if address is None else address
                     for name, address in zip(_DESCALES, self.descales)]
        self.main.launch(stream, *ptrs)
        if self.combine is not None:
            self.combine.launch(stream, ptrs[5], ptrs[6], o_ptr, lse_ptr)
        if self.return_lse:
            return o, lse.reshape(p.lse_shape())
        return o

    def _check_out(self, out, inputs):
        lib = self.arrays
        if _geometry(self.kind, out) != self.out_geometry:
            lib.explain_out(out, self.p.q_shape(), inputs[0][1].dtype, inputs)
        lo = lib.ptr(out)
        hi = lo + self.out_bytes
        for (name, a), (a_lo, a_hi) in zip(inputs, self.extents):
            start = lib.ptr(a)
            if self.out_bytes and a_hi > a_lo and lo < start + a_hi and start + a_lo < hi:
                raise ValueError(f"out: must not overlap input {name}")
