"""Honest accounting: exact pair and FLOP counts, the device-memory boundary, and an HBM-traffic model.

Three questions that are easy to conflate, answered separately:

* :func:`flops` — how much arithmetic the dense operator does: the exact number of visible
  (query, key) pairs under the mask, times the products' multiply-adds, next to the peers'
  "dense-equivalent" convention, each result stating which convention it uses.
* :func:`memory_report` — which device bytes exist while a pass runs, by class: inputs, outputs,
  saved state, workspace, quadratic intermediates (reference only), and on-chip storage per block
  (which is *not* device memory). Nothing is called "auxiliary" that is really an input or output.
* :func:`io_model` — the logical HBM traffic of a tile schedule, counted tile by tile, next to the
  FlashAttention paper's Theta(N^2 d^2 / M) and standard attention's Theta(N d + N^2). A model, not a
  measurement: caches, transaction sizes and write-back timing change what a profiler sees.

All counts are Python ints (exact, never overflow). Mask semantics follow :mod:`cuflash.core.masks`.
"""

from __future__ import annotations

import math
from collections import Counter
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from .core import masks, sequence_split
from .core.arrays import BFLOAT16, FLOAT16, FLOAT32, SUPPORTED_DTYPES, dtype_name
from .core.fp8_inputs import E4M3
from .core.problem import check_offset_values, check_out_dtype
from .kernels.fp8_forward import VT_GROUP, vt_keys
from .plan import decode, dispatch, schedule
from .plan import forward as plan_forward
from .plan.hopper import split_partials
from .plan.target import H200

PASSES = ("fwd", "bwd", "fwd+bwd")
METHODS = ("tiled", "reference")
LAYOUTS = ("bhsd", "bshd")

# The H200's shared memory per SM (device attribute MaxSharedMemoryPerMultiprocessor, 233472 bytes
# = 228 KiB): the "SRAM" of the FlashAttention paper's two-level model for this chip.
H200_SMEM_PER_SM_BYTES = 228 * 1024

LSE_ITEMSIZE = 4  # row statistics and accumulators are float32 whatever the input dtype
ACC_ITEMSIZE = 4


# --------------------------------------------------------------------------- argument checks


def _check_int(name, x, minimum=0):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__}")
    x = int(x)
    if x < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
    return x


def _check_shape(name, s):
    if isinstance(s, (str, bytes)) or not hasattr(s, "__iter__"):
        raise TypeError(f"{name}: expected a shape (a tuple of integers), got {type(s).__name__}")
    return tuple(_check_int(f"{name}[{i}]", x) for i, x in enumerate(s))


def _check_choice(name, x, choices):
    if x not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {x!r}")
    return x


def _check_dtype(name, dtype, e4m3=False):
    """A float16 / bfloat16 / float32 dtype (``e4m3``: float8_e4m3fn too), else TypeError naming it."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return BFLOAT16
    if isinstance(dtype, str) and dtype.lower() in ("float8_e4m3fn", "e4m3"):
        dtype = E4M3
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: not a dtype: {dtype!r}") from e
    if e4m3 and dt == E4M3:
        return dt
    if dt not in SUPPORTED_DTYPES:
        also = ("" if e4m3 else "; float8_e4m3fn is modelled by memory_report and io_model (the e4m3 forward)"
                if dt == E4M3 else "")
        wants = "float16, bfloat16, float32 or float8_e4m3fn" if e4m3 else "float16, bfloat16 or float32"
        raise TypeError(f"{name}: dtype {dtype_name(dt)} is not supported; expected {wants}{also}")
    return dt


def _int_list(name, x):
    """A sequence of ints (list, tuple, NumPy or CuPy array) as a list of Python ints."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        if getattr(x, "ndim", 1) != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of integers, got shape {x.shape}")
        if not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise TypeError(f"{name}: expected integers, got dtype {x.dtype}")
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of integers, got {type(x).__name__}")
    return [_check_int(f"{name}[{i}]", v) for i, v in enumerate(x)]


def _split_heads(name, shape, layout):
    """(batch, heads, seq, d) of one (..., H, N, d) / (..., N, H, d) / (N, d) shape."""
    if len(shape) < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions (N, d) or (..., H, N, d), got {shape}")
    if len(shape) == 2:
        return (), 1, shape[0], shape[1]
    if layout == "bhsd":
        return shape[:-3], shape[-3], shape[-2], shape[-1]
    return shape[:-3], shape[-2], shape[-3], shape[-1]


def _check_heads(hq, hkv, name="k"):
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: number of heads {hkv} must divide q's number of heads {hq} (MQA/GQA)")


# --------------------------------------------------------------------------- exact pair counts


def _sum_positive_linear(i0, i1, slope, intercept):
    """sum_{i0 <= i < i1} max(0, slope * i + intercept) for slope in {-1, 0, 1}, exactly."""
    if i1 <= i0:
        return 0
    if slope == 0:
        return max(0, intercept) * (i1 - i0)
    if slope == 1:  # positive from i = 1 - intercept on
        s = max(i0, 1 - intercept)
        return 0 if s >= i1 else (i1 - s) * ((s + intercept) + (i1 - 1 + intercept)) // 2
    e = min(i1, intercept)  # slope -1: positive while i <= intercept - 1
    return 0 if e <= i0 else (e - i0) * ((intercept - i0) + (intercept - e + 1)) // 2


def pairs_per_head(causal, nq, nk, window=None) -> int:
    """Exact visible (query, key) pairs of one head: sum over rows of the visible key count.

    Closed form (splitting the rows where the clip to [0, nk) switches on), so it is exact and O(1)
    for any N. Without a window this is :func:`cuflash.core.masks.pair_count`."""
    causal = masks.normalize_causal(causal)
    window = masks.normalize_window(window)
    if nq == 0 or nk == 0:
        return 0
    if window is None:
        return masks.pair_count(causal, nq, nk)
    lo, hi = masks.row_bounds(causal, window, nq, nk)
    last = nk - 1
    cuts = {0, nq}
    if hi is not None:
        cuts.add(last - hi)  # from this row on, i + hi >= last: the right end is clipped to last
    if lo is not None:
        cuts.add(-lo)  # from this row on, i + lo >= 0: the left end is i + lo, not 0
    points = sorted(c for c in cuts if 0 <= c <= nq)
    total = 0
    for i0, i1 in zip(points, points[1:]):
        # On [i0, i1) the count min(i + hi, last) - max(i + lo, 0) + 1 is one linear function.
        slope, intercept = 0, 1
        if hi is None or i0 >= last - hi:
            intercept += last
        else:
            slope, intercept = slope + 1, intercept + hi
        if lo is not None and i0 >= -lo:
            slope, intercept = slope - 1, intercept - lo
        total += _sum_positive_linear(i0, i1, slope, intercept)
    return total


def _sequence_lengths(q_shape, k_shape, layout, kv_lens, cu_seqlens_q, cu_seqlens_k):
    """(batch, hq, hkv, d, Counter of (nq_b, nk_b) per sequence) after checking every argument."""
    q_shape = _check_shape("q_shape", q_shape)
    k_shape = _check_shape("k_shape", k_shape)
    _check_choice("layout", layout, LAYOUTS)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
            raise ValueError(f"{missing}: varlen needs both cu_seqlens_q and cu_seqlens_k")
        for name, s in (("q_shape", q_shape), ("k_shape", k_shape)):
            if len(s) != 3:
                raise ValueError(f"{name}: with cu_seqlens expected packed (total, H, d), got {s}")
        (tq, hq, d), (tk, hkv, dk) = q_shape, k_shape
        cq, ck = _int_list("cu_seqlens_q", cu_seqlens_q), _int_list("cu_seqlens_k", cu_seqlens_k)
        for name, c, total in (("cu_seqlens_q", cq, tq), ("cu_seqlens_k", ck, tk)):
            check_offset_values(name, c, total, "q_shape[0]" if name == "cu_seqlens_q" else "k_shape[0]")
        if len(cq) != len(ck):
            raise ValueError(f"cu_seqlens_k: {len(ck) - 1} sequences, cu_seqlens_q has {len(cq) - 1}")
        batch = len(cq) - 1
        nqs = [b - a for a, b in zip(cq, cq[1:])]
        nks = [b - a for a, b in zip(ck, ck[1:])]
    else:
        qb, hq, nq, d = _split_heads("q_shape", q_shape, layout)
        kb, hkv, nk, dk = _split_heads("k_shape", k_shape, layout)
        if len(q_shape) != len(k_shape) or qb != kb:
            raise ValueError(f"k_shape: batch dimensions {kb} must equal q_shape's {qb}")
        batch = math.prod(qb)
        nqs, nks = [nq] * batch, [nk] * batch
    if dk != d:
        raise ValueError(f"k_shape: head dim {dk} must equal q_shape's head dim {d}")
    if d == 0:
        raise ValueError("q_shape: head dim d must be at least 1")
    _check_heads(hq, hkv, "k_shape")
    if kv_lens is not None:
        lens = _int_list("kv_lens", kv_lens)
        if len(lens) != batch:
            raise ValueError(f"kv_lens: expected one length per sequence ({batch}), got {len(lens)}")
        for b, (n, cap) in enumerate(zip(lens, nks)):
            if n > cap:
                raise ValueError(f"kv_lens[{b}]: {n} is longer than the {cap} keys stored")
        nks = lens
    return batch, hq, hkv, d, Counter(zip(nqs, nks))


# --------------------------------------------------------------------------- flops


FWD_PRODUCTS = "S = Q K^T and O = P V"
BWD_PRODUCTS = "S = Q K^T (recomputed), dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q"
_EXACT_PER_PAIR = {"fwd": 4, "bwd": 10, "fwd+bwd": 14}  # 2 FLOPs per multiply-add per product
_DENSE_FACTOR_X2 = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}  # (4, 10, 14) * pairs / 2: bwd 2.5x, fwd+bwd 3.5x


@dataclass(frozen=True)
class FlopCount:
    """Exact arithmetic of one attention pass, next to the peers' dense-equivalent figure."""

    pass_: str
    pairs: int  # exact visible (query, key) pairs, summed over sequences and query heads
    head_dim: int
    flops: int  # exact: products' multiply-adds over the visible pairs, 2 FLOPs each
    dense_equivalent: int  # peers' convention (see dense_convention)
    convention: str
    dense_convention: str
    # score modifiers' elementwise operations over the visible pairs (not in flops, like the
    # softmax): a softcap's tanh (and in the backward its derivative), ALiBi's bias FMA
    elementwise: int = 0

    def tflops_per_s(self, seconds: float) -> float:
        """Exact FLOPs per second in TFLOP/s (the figure to quote for this kernel)."""
        return self.flops / float(seconds) / 1e12

    def dense_tflops_per_s(self, seconds: float) -> float:
        """Peers' dense-equivalent TFLOP/s, comparable with their published tables."""
        return self.dense_equivalent / float(seconds) / 1e12

    def __str__(self):
        return (f"{self.pass_}: pairs={self.pairs:,} flops={self.flops:,} [{self.convention}]; "
                f"dense-equivalent={self.dense_equivalent:,} [{self.dense_convention}]")


def flops(q_shape, k_shape, *, causal=False, window=None, kv_lens=None, cu_seqlens_q=None,
          cu_seqlens_k=None, layout="bhsd", pass_="fwd", softcap=None, alibi_slopes=None, sinks=None,
          dv=None) -> FlopCount:
    """Exact pair and FLOP counts of attention over q of ``q_shape`` and k, v of ``k_shape``.

    Shapes are (..., H, N, d) (``layout="bhsd"``), (..., N, H, d) (``"bshd"``) or (N, d); with
    ``cu_seqlens_q``/``cu_seqlens_k`` (varlen, B + 1 cumulative offsets each) they are packed
    (total, H, d). ``kv_lens`` gives each sequence's valid key count (a KV cache filled to that
    length): its mask is that of a (Nq, kv_lens[b]) problem, bottom-right causal alignment
    included. ``window=(left, right)``: FlashAttention's sliding window, -1 = unbounded, as
    defined by :func:`cuflash.core.masks.row_bounds` (the backends' definition).

    Exact: forward 4 * pairs * d (S = QK^T and O = PV, 2 FLOPs per multiply-add), backward
    10 * pairs * d (S recomputed, dP, dV, dQ, dK), "fwd+bwd" 14 * pairs * d. Softmax, scaling and
    masking are not counted. dense_equivalent is the peers' 4 * B * H * Nq * Nk * d, halved when
    causal, ignoring windows (backward 2.5x that): use it only to compare with their tables.

    ``dv``: v's (and o's) head dim where it differs from q's and k's d. Products over d: S and, in
    the backward, dQ and dK; over dv: O = P V and, in the backward, dP and dV. Forward
    2 * pairs * (d + dv), backward 2 * pairs * (3 d + 2 dv), "fwd+bwd" 2 * pairs * (4 d + 3 dv).
    The dense equivalent then counts (d + dv) / 2 for d.

    The counts depend on no dtype: float8_e4m3fn q, k, v (the e4m3 forward, pass_="fwd") multiply
    the same products over the same visible pairs, 4 * pairs * d.

    Score modifiers (any value but None turns one on; only whether it is given matters) change no
    product: ``elementwise`` counts their work per visible pair apart - the softcap 1 tanh forward,
    2 backward (the tanh recomputed and the derivative 1 - tanh^2 applied to dS), ALiBi 1 fused
    multiply-add each pass - one operation each. Sinks add one term per row (not counted).
    """
    _check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    window = masks.normalize_window(window)
    batch, hq, _, d, lengths = _sequence_lengths(q_shape, k_shape, layout, kv_lens, cu_seqlens_q, cu_seqlens_k)
    dv = d if dv is None else _check_int("dv", dv, minimum=1)
    pairs = hq * sum(n * pairs_per_head(causal, nq, nk, window) for (nq, nk), n in lengths.items())
    dense_pairs = hq * sum(n * nq * nk for (nq, nk), n in lengths.items())
    # exact integers when d + dv is even (always when dv = d): the causal halving and the 2.5x / 3.5x.
    dense = _DENSE_FACTOR_X2[pass_] * dense_pairs * (d + dv) * (1 if causal else 2) // 2
    products = {"fwd": FWD_PRODUCTS, "bwd": BWD_PRODUCTS, "fwd+bwd": f"{FWD_PRODUCTS}; {BWD_PRODUCTS}"}[pass_]
    conv = (f"exact: {_EXACT_PER_PAIR[pass_]}*pairs*d = 2 FLOPs per multiply-add of {products}, over the "
            "visible (query, key) pairs only; softmax, scaling and masking not counted")
    dconv = ("peers' dense-equivalent: 4*H*d*sum_b(Nq_b*Nk_b)"
             + (", halved for causal" if causal else "")
             + {"fwd": "", "bwd": ", x2.5 for the backward", "fwd+bwd": ", x3.5 for fwd+bwd"}[pass_]
             + ("; window ignored by this convention (the exact count applies it)" if window is not None else "")
             + ("; Nk_b = kv_lens[b]" if kv_lens is not None else ""))
    per_pair = {"fwd": 0, "bwd": 0}
    if softcap is not None:
        per_pair["fwd"] += 1
        per_pair["bwd"] += 2
    if alibi_slopes is not None:
        per_pair["fwd"] += 1
        per_pair["bwd"] += 1
    elementwise = pairs * {"fwd": per_pair["fwd"], "bwd": per_pair["bwd"], "fwd+bwd": sum(per_pair.values())}[pass_]
    if elementwise:
        conv += "; score modifiers: elementwise, counted apart"
    if dv != d:
        conv = conv.replace(f"{_EXACT_PER_PAIR[pass_]}*pairs*d", {"fwd": "2*pairs*(d+dv)", "bwd": "2*pairs*(3d+2dv)",
                                                                   "fwd+bwd": "2*pairs*(4d+3dv)"}[pass_])
    exact = 2 * pairs * {"fwd": d + dv, "bwd": 3 * d + 2 * dv, "fwd+bwd": 4 * d + 3 * dv}[pass_]
    return FlopCount(pass_, pairs, d, exact, dense, conv, dconv, elementwise)


# --------------------------------------------------------------------------- memory


INPUT, OUTPUT, SAVED, WORKSPACE, INTERMEDIATE, ON_CHIP = (
    "input", "output", "saved state", "workspace", "intermediate", "on-chip (not device memory)")
CATEGORIES = (INPUT, OUTPUT, SAVED, WORKSPACE, INTERMEDIATE, ON_CHIP)
_TRANSIENT = (WORKSPACE, INTERMEDIATE)  # alive only during one phase of the pass


@dataclass(frozen=True)
class MemoryEntry:
    name: str
    category: str  # one of CATEGORIES
    bytes: int
    note: str = ""
    phase: str = "all"  # "fwd" / "bwd": a transient that exists only during that phase
    reuses: str | None = None  # an entry whose buffer this one may overwrite (in-place variant)


@dataclass(frozen=True)
class MemoryReport:
    """Device bytes of one pass, by category. Transients of different phases never coexist."""

    method: str
    pass_: str
    dtype: str
    shape: dict
    entries: tuple
    notes: tuple = ()

    def total(self, category) -> int:
        return sum(e.bytes for e in self.entries if e.category == category)

    def _device_bytes(self, in_place):
        persistent = sum(e.bytes for e in self.entries if e.category in (INPUT, OUTPUT, SAVED))
        phases = {e.phase for e in self.entries if e.category in _TRANSIENT}
        peak = max((sum(e.bytes for e in self.entries if e.category in _TRANSIENT and e.phase == ph
                        and not (in_place and e.reuses)) for ph in phases), default=0)
        return persistent + peak

    @property
    def device_bytes(self) -> int:
        """Peak device bytes: inputs + outputs + saved state + the largest phase's transients."""
        return self._device_bytes(False)

    @property
    def device_bytes_in_place(self) -> int:
        """The same when every intermediate that can overwrite another one does."""
        return self._device_bytes(True)

    @property
    def beyond_inputs_outputs(self) -> int:
        """What the method adds to the unavoidable inputs and outputs (saved state included)."""
        return self.device_bytes - self.total(INPUT) - self.total(OUTPUT)

    @property
    def beyond_inputs_outputs_in_place(self) -> int:
        return self.device_bytes_in_place - self.total(INPUT) - self.total(OUTPUT)

    def table(self) -> str:
        s = self.shape
        head = (f"memory [{self.method}, {self.pass_}] B={s['batch']} Hq={s['hq']} Hkv={s['hkv']} "
                f"Nq={s['nq']} Nk={s['nk']} d={s['d']}" + (f" dv={s['dv']}" if "dv" in s else "") + f" {self.dtype}")
        show_phase = self.pass_ == "fwd+bwd"
        rows = [(e.category, e.name + (f" ({e.phase} phase)" if show_phase and e.phase != "all" else ""),
                 f"{e.bytes:,}", _mib(e.bytes), e.note) for e in self.entries]
        rows.append(("total device", "peak, all phases", f"{self.device_bytes:,}", _mib(self.device_bytes), ""))
        rows.append(("beyond in/out", "total - inputs - outputs", f"{self.beyond_inputs_outputs:,}",
                     _mib(self.beyond_inputs_outputs), "saved state + workspace + intermediates"))
        if any(e.reuses for e in self.entries):
            rows.append(("total device", "in-place variant", f"{self.device_bytes_in_place:,}",
                         _mib(self.device_bytes_in_place), "each reusable intermediate overwrites another"))
            rows.append(("beyond in/out", "in-place variant", f"{self.beyond_inputs_outputs_in_place:,}",
                         _mib(self.beyond_inputs_outputs_in_place), ""))
        out = head + "\n" + format_table(("category", "name", "bytes", "MiB", "note"), rows)
        return out + "".join(f"\nnote: {n}" for n in self.notes)

    __str__ = table


def _mib(n):
    return f"{n / 2**20:,.2f}"


def _as_shape_and_dtype(name, x):
    """An array gives (shape, dtype); a shape gives (shape, None)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(s) for s in x.shape), np.dtype(x.dtype)
    return _check_shape(name, x), None


def _input_dtype(named, dtype, bits=False):
    """The inputs' one dtype: ``dtype`` (the arrays' must equal it), else the arrays', else bfloat16.
    A uint8 array holds float8_e4m3fn bits (as CuPy holds e4m3, core.fp8_inputs) where ``dtype``
    is float8_e4m3fn or ``bits`` (a descale was given: cuflash.attention's rule)."""
    want = None if dtype is None else _check_dtype("dtype", dtype, e4m3=True)
    dtypes = {}
    for name, x in named:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            adt = np.dtype(x.dtype)
            if adt == np.uint8 and (want == E4M3 or bits):
                adt = E4M3
            dtypes[name] = _check_dtype(name, adt, e4m3=True)
    if want is not None:
        for name, adt in dtypes.items():
            if adt != want:
                raise TypeError(f"{name}: dtype {dtype_name(adt)} differs from dtype={dtype_name(want)}")
        return want
    if dtypes:
        want = next(iter(dtypes.values()))
        for name, adt in dtypes.items():
            if adt != want:
                raise TypeError(f"{name}: dtype {dtype_name(adt)} differs from the other inputs' {dtype_name(want)}")
        return want
    return BFLOAT16  # shapes only and no dtype: the common training dtype (stated in the report)


def _problem_dims(q, k, v, layout, dtype, bits=False):
    _check_choice("layout", layout, LAYOUTS)
    named = [("q", q), ("k", k), ("v", k if v is None else v)]
    shapes = {name: _as_shape_and_dtype(name, x)[0] for name, x in named}
    dt = _input_dtype(named, dtype, bits)
    qb, hq, nq, d = _split_heads("q", shapes["q"], layout)
    kb, hkv, nk, dk = _split_heads("k", shapes["k"], layout)
    vb, hv, nv, dv = _split_heads("v", shapes["v"], layout)
    if not (len(shapes["q"]) == len(shapes["k"]) == len(shapes["v"])) or kb != qb or vb != qb:
        raise ValueError(f"k, v: batch dimensions {kb}, {vb} must equal q's {qb}")
    if dk != d:
        raise ValueError(f"k: head dim {dk} must equal q's head dim {d}")
    if dv == 0:
        raise ValueError("v: head dim must be at least 1")
    if (hv, nv) != (hkv, nk):
        raise ValueError(f"v: heads and length ({hv}, {nv}) must equal k's ({hkv}, {nk})")
    if d == 0:
        raise ValueError("q: head dim d must be at least 1")
    _check_heads(hq, hkv)
    return SimpleNamespace(batch=math.prod(qb), hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv, dtype=dt)


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


def _check_head_dim(d, shape_name):
    if d > schedule.MAX_HEAD_DIM:
        raise ValueError(f"{shape_name}: head dim {d} is larger than the tiled kernels' largest, {schedule.MAX_HEAD_DIM}")


def _check_config(config, name="config"):
    for attr in ("block_m", "block_n"):
        if not isinstance(getattr(config, attr, None), int) or getattr(config, attr) < 1:
            raise TypeError(f"{name}: expected a cuflash.plan.schedule.TileConfig (positive block_m, block_n), got {config!r}")
    return config


# The accounting plans for the modelled H200 (132 SMs) with contiguous, 16-byte-aligned arrays,
# through the dispatch the launchers read (plan.dispatch), whatever GPU this machine has.
MODEL = H200
H200_SM_COUNT = MODEL.sm_count


def _model_problem(dtype, d, causal, nq=None, nk=None, batch=None, hq=None, hkv=None, dv=None):
    """The few problem fields the dispatch reads (lengths None: the tables' tiles)."""
    kind = masks.normalize_causal(causal)
    hkv = hkv or hq
    return SimpleNamespace(dtype=np.dtype(dtype), d=d, dv=d if dv is None else dv, causal=kind, nq=nq, nk=nk,
                           batch=batch, hq=hq, hkv=hkv, group=(hq // hkv) if hq and hkv else 1, window=None)


def _backward_plan(dtype, d, causal, deterministic):
    """The backward plan on the modelled H200, or None where no GPU kernel exists for the dtype."""
    try:
        return dispatch.backward_plan(_model_problem(dtype, d, causal), MODEL, dispatch.ALIGNED,
                                      deterministic=bool(deterministic), tuned=False)
    except (NotImplementedError, KeyError):
        return None


def _dq_accumulator_width(dtype, hd, deterministic, causal=False) -> int:
    """Floats per row of the modelled GPU's dQ accumulator (plan.dispatch.BackwardPlan.acc_head_dim)."""
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan.acc_head_dim if plan is not None and plan.kernel != "fp32" else hd


def _backward_frag_dq(dtype, hd, causal, deterministic) -> bool:
    """Whether the modelled GPU's backward adds dQ in fragment-order chunks (the warp-specialized
    wgmma kernel, or the split-head-dim one with dQ staged in its Q/dO tiles)."""
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan is not None and plan.frag_dq


def _backward_on_wgmma(dtype, hd, causal, deterministic) -> bool:
    plan = _backward_plan(dtype, hd, causal, deterministic)
    return plan is not None and plan.kernel == "wgmma"


def model_forward_plan(dtype, d, causal=False, nq=None, nk=None, batch=None, hq=None):
    """plan.dispatch.forward_plan of this shape on the modelled H200 (contiguous arrays)."""
    return dispatch.forward_plan(_model_problem(np.dtype(dtype), d, causal, nq, nk, batch, hq), MODEL, dispatch.ALIGNED,
                                 tuned=False)


def forward_launch(dtype, d, causal=False, config=None, nq=None, nk=None, batch=None, hq=None, dv=None, hkv=None):
    """Tile, shared memory and threads of the forward kernel cuflash launches (contiguous arrays) on
    the modelled GPU, the H200: plan.dispatch.forward_plan's (the wgmma kernel where it applies;
    CUFLASH_KERNELS=mma_sync: the mma.sync kernel). With the sequence lengths (nq, nk) and the grid
    (batch, hq), the tile and key split the dispatch picks for them, else the table's.

    ``dv``: v's head dim where it differs from d: the dv kernel's launch where
    plan.dispatch.head_dim_v_plan takes the problem (``hd_v``: v's head-dim bucket), else the
    padded problem's, at max(d, dv) (``hkv``: the K/V heads, for the split-KV decode rule).

    A ``config`` replaces the table's TileConfig (its smem_bytes is then trusted)."""
    dtype = _check_dtype("dtype", dtype)
    if dv is not None and dv != d:
        native = _forward_dv_launch(dtype, d, dv, causal, nq, nk, batch, hq, hkv) if config is None else None
        if native is not None:
            return native
        d = max(d, dv)
    hd = schedule.head_dim_bucket(d)
    if config is not None:
        _check_config(config)
        return SimpleNamespace(block_m=config.block_m, block_n=config.block_n, hd=hd, threads=config.threads,
                               smem=config.smem_bytes(hd, dtype.itemsize), source="config")
    try:
        plan = model_forward_plan(dtype, d, causal, nq, nk, batch, hq)
    except (NotImplementedError, KeyError):
        _, t = schedule.forward_tile(d)
        return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=hd, threads=t.threads,
                               smem=t.smem_bytes(hd, dtype.itemsize), source="schedule.FORWARD_TILES")
    t, spec = plan.tile, plan.spec
    return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=hd, threads=spec.threads,
                           smem=spec.smem_bytes, source=spec.short_name)


def _forward_dv_launch(dtype, d, dv, causal, nq=None, nk=None, batch=None, hq=None, hkv=None):
    """forward_launch's answer for the dv kernel where plan.dispatch.head_dim_v_plan runs v's head
    dim dv unlike d on the modelled H200 (contiguous arrays), else None (the GPU pads)."""
    plan = dispatch.head_dim_v_plan(_model_problem(dtype, d, causal, nq, nk, batch, hq, hkv, dv=dv), MODEL,
                                    dispatch.ALIGNED)
    if plan is None:
        return None
    t, spec = plan.tile, plan.spec
    return SimpleNamespace(block_m=t.block_m, block_n=t.block_n, hd=schedule.head_dim_bucket(d),
                           hd_v=schedule.head_dim_bucket(dv), threads=spec.threads, smem=spec.smem_bytes,
                           source=spec.short_name)


def _forward_key_split(p, causal):
    """(slots, rows, columns) of the key split's float32 partials in the forward cuflash launches
    on the modelled H200 for this shape (contiguous inputs), or None."""
    if p.nq == 0:
        return None
    mp = _model_problem(p.dtype, p.d, causal, p.nq, p.nk, p.batch, p.hq)
    try:
        plan = dispatch.forward_plan(mp, MODEL, dispatch.ALIGNED, tuned=False)
    except (NotImplementedError, KeyError):
        return None
    return split_partials(mp, plan.tile, plan.splits) if plan.kernel == "wgmma_split" else None


def _decode_launch(dtype, d, causal, batch, hq, hkv, nq, nk, cluster=None, kv_e4m3=False):
    """The split-KV decode launch cuflash makes for this shape (contiguous inputs), or None.
    cluster=False: the launch whose splits merge through memory (plan.decode.launch_plan).
    kv_e4m3: an e4m3 K/V cache (plan.decode.e4m3_launch's tile and waves)."""
    p = SimpleNamespace(dtype=dtype, d=d, nq=nq, nk=nk, hq=hq, hkv=hkv, group=hq // hkv, batch=batch,
                        causal=masks.normalize_causal(causal), window=None)
    if not (dispatch.decode_applies_e4m3 if kv_e4m3 else dispatch.decode_applies)(p, True):
        return None
    tile, waves = decode.e4m3_launch(p, H200_SM_COUNT) if kv_e4m3 else (None, None)
    lp = decode.launch_plan(p, H200_SM_COUNT, tile=tile, waves=waves, cluster=cluster)
    # (launch_plan's choice: the planner's own launch, wide-rows blocks included)
    row_blocks = decode.launch_problem(p, None if kv_e4m3 else H200_SM_COUNT, tile, cluster).hkv // hkv
    off = masks.causal_offset(p.causal, nq, nk)
    keys = nk if off is None else max(0, min(nk, nq + off))  # keys the last query token sees
    main = decode.launch_spec(dtype, d, p.causal is not None, lp)
    # cluster: the splits merge in the cluster's distributed shared memory (no partials in memory)
    # last_merges: the partials go through memory and the last split of each pair merges them
    last_merges = decode.last_split_merges(lp, p.group // row_blocks * nq, d)
    return SimpleNamespace(splits=lp.splits, cluster=lp.cluster, keys=keys, source=main.short_name,
                           smem=main.smem_bytes, threads=main.threads, rows=16 * lp.row_tiles, block_n=lp.tile.block_n,
                           last_merges=last_merges, row_blocks=row_blocks)


def backward_launch(dtype, d, causal=False, deterministic=False):
    """Tiles and shared memory of the backward kernels cuflash launches, or None where there is none.

    From plan.dispatch.backward_plan on the modelled H200: the K/V-parallel main kernel (block_n
    keys per block, streaming block_m query rows; the wgmma one where it applies) and, when
    deterministic, the separate dQ kernel. float32: attn_bwd_f32_kv (block_n keys, block_m-row
    query tiles) and attn_bwd_f32_dq, which always runs (row statistics, then dQ)."""
    dtype = _check_dtype("dtype", dtype)
    plan = _backward_plan(dtype, d, causal, deterministic)
    if plan is None:
        return None
    specs, t = plan.specs, plan.tile
    if plan.kernel == "fp32":  # the float64 kernels (tensor cores where they exist on the H200)
        return SimpleNamespace(block_m=t.kv_block_m, block_n=t.kv_block_n, hd=plan.head_dim, threads=specs["kv"].threads,
                               smem=specs["kv"].smem_bytes, source=specs["kv"].short_name,
                               dq_block_m=t.dq_block_m, dq_block_n=t.dq_block_n, dq_threads=specs["dq"].threads,
                               dq_smem=specs["dq"].smem_bytes, fp64=True)
    dq = specs.get("dq")
    kv_tile = plan.hopper or t
    return SimpleNamespace(block_m=kv_tile.block_m, block_n=kv_tile.block_n, hd=plan.head_dim, threads=specs["kv"].threads,
                           smem=specs["kv"].smem_bytes, source=specs["kv"].short_name,
                           dq_block_m=t.dq_block_m if dq else None, dq_block_n=t.dq_block_n if dq else None,
                           dq_threads=dq.threads if dq else None, dq_smem=dq.smem_bytes if dq else None, fp64=False)


# --------------------------------------------------------------------------- e4m3 forward

# fp8_pack_vt's static shared memory per block (cuda_src/fp8_vt.cu: 128 keys x (64 + 4) bytes; its
# KernelSpec lists no dynamic shared memory).
FP8_VT_SMEM_BYTES = 128 * (64 + 4)
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
        odt = _check_dtype("out_dtype", out_dtype)
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
            ds = _check_shape(name, x)
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


def _e4m3_memory_report(q, k, v, *, method, pass_, causal, window, layout, out_dtype, descales, cu_seqlens_q,
                        cu_seqlens_k, registers, refused) -> MemoryReport:
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
    shapes = [_as_shape_and_dtype(n, x)[0] for n, x in named]
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    notes = []
    if packed:
        if method != "tiled":
            raise ValueError("cu_seqlens_q: packed sequences are modelled for method='tiled' (the e4m3 band kernel)")
        n_seq, hq, hkv, d, _ = _sequence_lengths(shapes[0], shapes[1], "bshd", None, cu_seqlens_q, cu_seqlens_k)
        if len(shapes[2]) != 3 or shapes[2][:2] != shapes[1][:2]:
            raise ValueError(f"v: expected packed ({shapes[1][0]}, {hkv}, dv) like k, got {shapes[2]}")
        batch, nq, nk, dv = 1, shapes[0][0], shapes[1][0], shapes[2][2]
        offsets = len(_int_list("cu_seqlens_q", cu_seqlens_q))
        notes.append(f"packed: {n_seq} sequences, Nq and Nk are the totals; one launch of the band kernel over "
                     "(1, H, total, d) views")
    else:
        p = _problem_dims(q, k, v, layout, E4M3, bits=True)
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
                         "fp8_pack_vt: 128 keys x 64 columns (+4 bytes a row), static"))
    if registers is not None:
        registers = _check_int("registers", registers, minimum=1)
        E.append(MemoryEntry("registers / block (fwd)", ON_CHIP, registers * 4 * spec.threads,
                             f"{registers} registers/thread x {spec.threads} threads x 4 B"))
    notes.append("float8_e4m3fn: contiguous inputs; descales are read where they are (no copy)")
    return MemoryReport(method, pass_, dtype_name(E4M3), shape, tuple(E), tuple(notes))


def memory_report(q, k, v=None, *, method="tiled", pass_="fwd", dtype=None, causal=False, config=None,
                  layout="bhsd", splits=None, registers=None, deterministic=False, alibi_slopes=None,
                  sinks=None, out_dtype=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None, q_descale=None,
                  k_descale=None, v_descale=None) -> MemoryReport:
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
    (``window``: the band kernel) and fp8_pack_vt's. Reference: the dequantized float32 Q, K, V,
    the float32 o rounded to bfloat16, and S, P (NumPy arrays only: host memory).
    """
    _check_choice("method", method, METHODS)
    _check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    descales = (q_descale, k_descale, v_descale)
    dt = _input_dtype([("q", q), ("k", k), ("v", k if v is None else v)], dtype,
                      bits=any(x is not None for x in descales))
    if dt == E4M3:
        return _e4m3_memory_report(q, k, v, method=method, pass_=pass_, causal=causal, window=window, layout=layout,
                                   out_dtype=out_dtype, descales=descales, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, registers=registers,
                                   refused=dict(config=config, splits=splits, alibi_slopes=alibi_slopes, sinks=sinks))
    for name, x in zip(DESCALES, descales):
        if x is not None:
            raise TypeError(f"{name}: a descale goes with float8_e4m3fn inputs, not {dtype_name(dt)}")
    for name, x in (("window", window), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x is not None:
            raise ValueError(f"{name}: modelled for float8_e4m3fn inputs only (the {dtype_name(dt)} report covers "
                             "dense inputs without a window)")
    p = _problem_dims(q, k, v, layout, dtype)
    if p.dv != p.d:  # v's head dim unlike q's: the report at one width, narrowed
        if check_out_dtype(out_dtype):
            raise ValueError("out_dtype: float32 output is not modelled with v's head dim unlike q's")
        w = max(p.d, p.dv)
        shapes = [_as_shape_and_dtype(n, x)[0] for n, x in (("q", q), ("k", k), ("v", v))]
        wide = memory_report(*(s[:-1] + (w,) for s in shapes), method=method, pass_=pass_, dtype=p.dtype,
                             causal=causal, config=config, layout=layout, splits=splits, registers=registers,
                             deterministic=deterministic, alibi_slopes=alibi_slopes, sinks=sinks)
        # The forward on the dv kernel (no score modifiers, no forced tile or split count): no copies.
        native = (_forward_dv_launch(p.dtype, p.d, p.dv, causal, p.nq, p.nk, p.batch, p.hq, p.hkv)
                  if method == "tiled" and pass_ != "bwd" and config is None and splits is None
                  and alibi_slopes is None and sinks is None else None)
        return _narrowed(wide, p.d, p.dv, method == "tiled", native, registers)
    if check_out_dtype(out_dtype) and p.dtype != FLOAT32:
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
        shapes = [_as_shape_and_dtype(n, x)[0] for n, x in (("q", q), ("k", k), ("v", k if v is None else v))]
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
    if method == "tiled":
        _check_head_dim(p.d, "q")
        if config is not None:
            _check_config(config)
    # Few query tokens over a long cache run the split-KV decode kernel (forward): its shared
    # memory, and by default the splits it picks on the modelled H200 (132 SMs).
    dec = None
    if method == "tiled" and config is None and pass_ in ("fwd", "fwd+bwd"):
        # an explicit split count models the launch with partials in memory (merged by the last split)
        dec = _decode_launch(p.dtype, p.d, causal, p.batch, p.hq, p.hkv, p.nq, p.nk,
                             cluster=None if splits is None else False)
    if splits is None:
        splits = (getattr(config, "splits", None) or getattr(config, "num_splits", None)
                  or (dec.splits if dec and not dec.cluster else 1))
    splits = _check_int("splits", splits, minimum=1)
    if registers is not None:
        registers = _check_int("registers", registers, minimum=1)
    s = p.dtype.itemsize
    q_elems, kv_elems, rows = p.batch * p.hq * p.nq * p.d, p.batch * p.hkv * p.nk * p.d, p.batch * p.hq * p.nq
    nn = p.batch * p.hq * p.nq * p.nk  # one float32 score-sized matrix per query head
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    E, notes = [], []
    E += [MemoryEntry("Q", INPUT, q_elems * s, "B*Hq*Nq*d"),
          MemoryEntry("K", INPUT, kv_elems * s, "B*Hkv*Nk*d"),
          MemoryEntry("V", INPUT, kv_elems * s, "B*Hkv*Nk*d")]
    if bwd:
        if not fwd:
            E.append(MemoryEntry("O", INPUT, q_elems * s, "the forward's output, read by the backward"))
        E.append(MemoryEntry("dO", INPUT, q_elems * s, "upstream gradient, B*Hq*Nq*d"))
    for name, a, what in (("ALiBi slopes", alibi_slopes, "float32 (Hq,) or (B, Hq)"),
                          ("sinks", sinks, "float32 (Hq,)")):
        if a is not None:
            shape = tuple(a.shape) if hasattr(a, "shape") else tuple(_int_list(name, a))
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
    if method == "tiled":
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
        key_split = _forward_key_split(p, causal) if fwd and config is None and dec is None else None
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
            frag = _backward_frag_dq(p.dtype, hd, causal, deterministic)
            width = _dq_accumulator_width(p.dtype, hd, deterministic)
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
    else:
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
    shape = dict(batch=p.batch, hq=p.hq, hkv=p.hkv, nq=p.nq, nk=p.nk, d=p.d)
    if dtype is None and not any(hasattr(x, "dtype") for x in (q, k, v)):
        notes.append("no arrays and no dtype given: bfloat16 assumed")
    return MemoryReport(method, pass_, dtype_name(p.dtype), shape, tuple(E), tuple(notes))


# --------------------------------------------------------------------------- HBM traffic model


@dataclass(frozen=True)
class IOEntry:
    name: str
    reads: int  # elements read from HBM
    writes: int  # elements written to HBM
    itemsize: int
    note: str = ""

    @property
    def bytes(self) -> int:
        return (self.reads + self.writes) * self.itemsize


@dataclass(frozen=True)
class IOModel:
    """Logical HBM traffic of a tile schedule, next to the paper's and standard attention's counts."""

    pass_: str
    batch: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: str
    causal: str | None
    block_m: int  # forward tile: query rows
    block_n: int  # forward tile: keys
    bwd_block_m: int  # backward main kernel: query rows streamed per step (0 without a backward)
    bwd_block_n: int  # backward main kernel: keys owned by one block
    entries: tuple
    sram_bytes: int
    sram_elements: int  # M of the paper: on-chip capacity in elements of the input dtype
    paper_elements: float  # Theta(Nq Nk d^2 / M) per head, unit constant, per pass
    standard_elements: int  # Theta((Nq + Nk) d + Nq Nk) per head, unit constant, per pass
    reference_elements: int  # the materializing reference, each N x N matrix written and read once
    computed_pairs: int  # (query, key) pairs inside the visible tiles the forward computes
    bwd_computed_pairs: int  # the same for the backward's main kernel (0 without a backward)
    compulsory_bytes: int  # Q, K, V read once; O and LSE written once (the forward's minimum)
    assumptions: tuple = field(default=())

    @property
    def read_elements(self) -> int:
        return sum(e.reads for e in self.entries)

    @property
    def write_elements(self) -> int:
        return sum(e.writes for e in self.entries)

    @property
    def elements(self) -> int:
        return self.read_elements + self.write_elements

    @property
    def read_bytes(self) -> int:
        return sum(e.reads * e.itemsize for e in self.entries)

    @property
    def write_bytes(self) -> int:
        return sum(e.writes * e.itemsize for e in self.entries)

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def table(self) -> str:
        head = (f"HBM traffic model [tiled, {self.pass_}] B={self.batch} Hq={self.hq} Hkv={self.hkv} "
                f"Nq={self.nq} Nk={self.nk} d={self.d} {self.dtype} causal={self.causal} "
                f"fwd tile {self.block_m}x{self.block_n}"
                + (f", bwd tile {self.bwd_block_m}x{self.bwd_block_n}" if self.bwd_block_n else ""))
        rows = [(e.name, f"{e.reads:,}", f"{e.writes:,}", str(e.itemsize), f"{e.bytes:,}", e.note) for e in self.entries]
        rows.append(("total", f"{self.read_elements:,}", f"{self.write_elements:,}", "", f"{self.bytes:,}",
                     f"{self.bytes / 1e9:.4g} GB"))
        t = format_table(("tensor", "elements read", "elements written", "B/elem", "bytes", "note"), rows)
        extra = [
            f"compulsory (Q, K, V read once; O, LSE written once): {self.compulsory_bytes:,} bytes",
            f"tile schedule total: {self.elements:,} elements",
            f"FlashAttention paper Theta(Nq*Nk*d^2/M) x B*Hq, M = {self.sram_elements:,} elements "
            f"({self.sram_bytes:,} B on chip): {self.paper_elements:,.4g} elements (unit constant)",
            f"standard attention Theta((Nq+Nk)*d + Nq*Nk) x B*Hq: {self.standard_elements:,} elements (unit constant)",
            f"materializing reference, each N x N matrix written once and read once per use: "
            f"{self.reference_elements:,} elements",
        ]
        return "\n".join([head, t] + extra + [f"assumption: {a}" for a in self.assumptions])

    __str__ = table


def _bisect_first(lo, hi, pred):
    """Smallest i in [lo, hi) with pred(i) true (pred monotone false -> true), or hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _visible_key_columns(causal, nq, nk, row0, row1, bn):
    """Keys in the visible K/V tiles of query rows [row0, row1): tiles are a prefix of the row."""
    n_tiles = -(-nk // bn)
    # tile_is_visible is true for a prefix of the K/V tiles: find the first invisible one.
    first_hidden = _bisect_first(0, n_tiles, lambda t: not masks.tile_is_visible(causal, nq, nk, row0, row1, t * bn))
    return min(nk, first_hidden * bn)


def _visible_query_rows(causal, nq, nk, col0, bm):
    """Query rows in the query tiles that see K/V tile starting at col0: a suffix of the tiles."""
    m_tiles = -(-nq // bm)
    first = _bisect_first(0, m_tiles, lambda t: masks.tile_is_visible(causal, nq, nk, t * bm, min(nq, (t + 1) * bm), col0))
    return nq - min(nq, first * bm)


def _kv_tile_reads(causal, nq, nk, bm, bn):
    """(keys loaded, pairs computed) summed over the query tiles of one head, tile by tile."""
    keys = pairs = 0
    for row0 in range(0, nq, bm):
        row1 = min(nq, row0 + bm)
        cols = _visible_key_columns(causal, nq, nk, row0, row1, bn)
        keys += cols
        pairs += (row1 - row0) * cols
    return keys, pairs


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


def _visible_key_tiles(causal, nq, nk, row0, row1, bn):
    """K/V tiles (of bn keys) that query rows [row0, row1) see: a prefix of the row's tiles."""
    n_tiles = -(-nk // bn)
    return _bisect_first(0, n_tiles, lambda t: not masks.tile_is_visible(causal, nq, nk, row0, row1, t * bn))


def _paper_bound(assumptions, passes_bh, nq, nk, d, M, sram, itemsize, default_sram):
    """(paper, standard) element counts of FlashAttention's Theorem 2 bound Theta(Nq Nk d^2 / M) and
    of the standard implementation, over ``passes_bh`` (passes x batch x query heads) problems with
    M elements (``sram`` bytes of ``itemsize``) on chip; appends where the bound's premises do not hold."""
    paper = passes_bh * nq * nk * d * d / M
    standard = passes_bh * ((nq + nk) * d + nq * nk)
    if paper < passes_bh * (nq + nk) * d:
        assumptions.append("the paper's count leaves out reading the inputs once, Theta((Nq+Nk) d), "
                           "which dominates at this shape (e.g. decoding)")
    if M > nk * d:
        assumptions.append(f"M = {M} > Nk*d = {nk * d}: the paper's bound assumes d <= M <= N d")
    assumptions.append(f"M = {sram:,} bytes of on-chip storage / {itemsize} B per element"
                       + (" (H200 shared memory per SM, 228 KiB)" if default_sram else ""))
    return paper, standard


def _e4m3_io_model(batch, hq, hkv, nq, nk, d, causal, pass_, config, kv_dtype, out_dtype, sram_bytes) -> IOModel:
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
        end = _visible_key_tiles(causal, nq, nk, row0, row1, bn) * bn
        k_keys += min(nk, end)
        vt_cols += min(nk_pad, end)
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
    sram = H200_SMEM_PER_SM_BYTES if sram_bytes is None else _check_int("sram_bytes", sram_bytes, minimum=1)
    M = sram  # elements of one byte
    assumptions.append(f"e4m3 forward tile {bm}x{bn} from {spec.short_name}; every query head rereads its K and vt "
                       "tiles (GQA heads share no loads)")
    assumptions.append("vt (V transposed, keys in groups of 32) is built by fp8_pack_vt on every call; the descales' "
                       "float32 factors (a few per block) are not counted; contiguous (B, H, N, d) inputs")
    if causal is not None:
        assumptions.append("causal: only K/V tiles with masks.tile_is_visible are loaded")
    reference = bh * (4 * nq * nk + 2 * (nq + nk) * d + nq)
    paper, standard = _paper_bound(assumptions, bh, nq, nk, d, M, sram, 1, sram_bytes is None)
    compulsory = qe + 2 * kve + qe * os_ + rows * LSE_ITEMSIZE
    return IOModel(pass_, batch, hq, hkv, nq, nk, d, dtype_name(E4M3), causal, bm, bn, 0, 0, tuple(entries),
                   sram, M, paper, standard, reference, computed, 0, compulsory, tuple(assumptions))


def io_model(shape, config=None, *, dtype="bfloat16", causal=False, pass_="fwd", sram_bytes=None,
             nk=None, hkv=None, deterministic=False, kv_dtype=None, out_dtype=None) -> IOModel:
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
    _check_choice("pass_", pass_, PASSES)
    causal = masks.normalize_causal(causal)
    shape = _check_shape("shape", shape)
    if len(shape) != 4:
        raise ValueError(f"shape: expected (B, H, N, d), got {shape}")
    batch, hq, nq, d = shape
    if d == 0:
        raise ValueError("shape: head dim d must be at least 1")
    _check_head_dim(d, "shape")
    nk = nq if nk is None else _check_int("nk", nk)
    hkv = hq if hkv is None else _check_int("hkv", hkv)
    _check_heads(hq, hkv, "hkv")
    dt = _check_dtype("dtype", dtype, e4m3=True)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if dt == E4M3:
        return _e4m3_io_model(batch, hq, hkv, nq, nk, d, causal, pass_, config, kv_dtype, out_dtype, sram_bytes)
    if out_dtype is not None:
        raise ValueError(f"out_dtype: taken with dtype float8_e4m3fn only ({dtype_name(dt)} o has q's dtype here)")
    s = dt.itemsize
    kv_e4m3 = _check_kv_dtype(kv_dtype, dt, pass_, config)
    fl = forward_launch(dt, d, causal, config, nq, nk, batch, hq)
    bm, bn, hd = fl.block_m, fl.block_n, fl.hd
    sram = H200_SMEM_PER_SM_BYTES if sram_bytes is None else _check_int("sram_bytes", sram_bytes, minimum=1)
    M = max(1, sram // s)
    bh, bhkv = batch * hq, batch * hkv
    qe, kve, rows = bh * nq * d, bhkv * nk * d, bh * nq
    assumptions = []
    entries = []
    fwd, bwd = pass_ in ("fwd", "fwd+bwd"), pass_ in ("bwd", "fwd+bwd")
    prefix = (lambda ph: f"{ph}: ") if pass_ == "fwd+bwd" else (lambda ph: "")

    kv_keys, computed = _kv_tile_reads(causal, nq, nk, bm, bn)
    computed *= bh
    dec = _decode_launch(dt, d, causal, batch, hq, hkv, nq, nk, kv_e4m3=kv_e4m3) if config is None else None
    if kv_e4m3 and dec is None:
        raise ValueError(f"kv_dtype: an e4m3 cache runs the split-KV decode kernel only, which does not take "
                         f"shape {shape} with nk={nk}, hkv={hkv} (decode shapes, d a multiple of 16 up to 256)")
    skv = 1 if kv_e4m3 else s
    if fwd and dec is not None:
        # Split-KV decode: all query rows of a K/V head share one pass over its cache.
        p = prefix("fwd")
        # partials go through memory only when the splits do not merge in a cluster
        part_rows = bhkv * dec.splits * (hq // hkv) * nq if dec.splits > 1 and not dec.cluster else 0
        rb = dec.row_blocks
        kv_note = ("once per K/V head (GQA rows packed into one tile)" if rb == 1 else
                   f"once per K/V head and row block: {rb} blocks of {hq // hkv // rb} query heads each "
                   "(reads after the first come from L2 when the row blocks run together)")
        entries += [
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
        computed = bh * masks.pair_count(causal, nq, nk)
        fwd = False  # the prefill model below does not apply
    if fwd:
        p = prefix("fwd")
        entries += [
            IOEntry(p + "Q", qe, 0, s, "read once"),
            IOEntry(p + "K", bh * kv_keys * d, 0, s, f"once per query tile ({bm} rows) per query head"),
            IOEntry(p + "V", bh * kv_keys * d, 0, s, f"once per query tile ({bm} rows) per query head"),
            IOEntry(p + "O", 0, qe, s, "written once"),
            IOEntry(p + "LSE", 0, rows, LSE_ITEMSIZE, "float32, written once"),
        ]
        split = (_forward_key_split(SimpleNamespace(dtype=dt, batch=batch, hq=hq, nq=nq, nk=nk, d=d), causal)
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
    bbm = bbn = bwd_computed = 0
    if bwd:
        p = prefix("bwd")
        bl = backward_launch(dt, d, causal, deterministic) if config is None else None
        if config is not None:
            bbm, bbn, src = config.block_m, config.block_n, "config"
        elif bl is not None:
            bbm, bbn, src = bl.block_m, bl.block_n, bl.source
        else:
            bbm, bbn, src = bm, bn, f"the forward's tile (no {dtype_name(dt)} GPU backward kernel)"
        q_rows = bwd_computed = visited = 0  # query rows revisited, summed over K/V tiles; tiles with any
        for col0 in range(0, nk, bbn):
            r = _visible_query_rows(causal, nq, nk, col0, bbm)
            q_rows += r
            visited += r > 0
            bwd_computed += r * (min(nk, col0 + bbn) - col0)
        bwd_computed *= bh
        if bl is not None and bl.fp64:  # float32 kernels: the dQ kernel's two passes form LSE and D itself
            dq_keys, _ = _kv_tile_reads(causal, nq, nk, bl.dq_block_m, bl.dq_block_n)
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
    if bwd and not (bl is not None and bl.fp64):
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
        if not deterministic and config is None and _backward_frag_dq(dt, hd, causal, deterministic):
            # bulk reduce-adds of whole 64 x 64 chunks: every column of the bucket, rows to a multiple of 64
            # (the kernel's HEAD_DIM columns: 192 runs the 256 kernel)
            pad = -(-nq // 64) * 64 - nq
            width = _dq_accumulator_width(dt, hd, deterministic, causal)
            added = bh * (q_rows + visited * pad) * width
            entries.append(IOEntry(p + "dQ accumulator", added + qe, schedule.dq_accumulator_floats(batch, hq, nq, width, True)
                                   + added, ACC_ITEMSIZE, f"float32, fragment order: zeroed (Nq padded to 64, {width} "
                                   "columns), read+written per visible tile (64 x 64 bulk reduce-adds), read once to convert"))
        elif not deterministic:
            # the wgmma K/V kernel adds every column of its HEAD_DIM (192: 256), the mma.sync one d
            hopper = config is None and _backward_on_wgmma(dt, hd, causal, deterministic)
            width = schedule.dq_accumulator_width(hd, hopper)
            cols = width if hopper else d
            entries.append(IOEntry(p + "dQ accumulator", bh * q_rows * cols + qe, rows * width + bh * q_rows * cols,
                                   ACC_ITEMSIZE, f"float32: zeroed ({width}-wide rows), {cols} columns read+written "
                                   "per visible tile (atomics), read once to convert"))
        else:
            dbm = bl.dq_block_m if bl is not None and bl.dq_block_m else bm
            dbn = bl.dq_block_n if bl is not None and bl.dq_block_n else bn
            dq_keys, _ = _kv_tile_reads(causal, nq, nk, dbm, dbn)
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
    if bwd:
        assumptions.append(f"backward tile {bbm}x{bbn} from {src}: one program per K/V tile and K/V head loops "
                           "over the group's query heads")
        if causal is not None:
            assumptions.append("causal backward: a K/V tile revisits only the query tiles that see it")
    # The materializing reference per query head. Forward: S = QK^T (read Q, K; write S), softmax
    # (read S; write P, LSE), O = PV (read P, V; write O). Backward: S recomputed and P formed (read
    # Q, K, S, LSE; write S, P), dP = dO V^T, D = rowsum(dO*O), dS = P*(dP - D), dV = P^T dO,
    # dQ = dS K, dK = dS^T Q: ten N x N accesses, 7 Nq*d, 5 Nk*d and 3 Nq (LSE, D write, D read).
    reference = 0
    if fwd:
        reference += bh * (4 * nq * nk + 2 * (nq + nk) * d + nq)
    if bwd:
        reference += bh * (10 * nq * nk + 7 * nq * d + 5 * nk * d + 3 * nq)
    paper, standard = _paper_bound(assumptions, (int(fwd) + int(bwd)) * bh, nq, nk, d, M, sram, s, sram_bytes is None)
    compulsory = (qe + 2 * kve) * s + qe * s + rows * LSE_ITEMSIZE
    return IOModel(pass_, batch, hq, hkv, nq, nk, d, dtype_name(dt), causal, bm, bn, bbm, bbn, tuple(entries),
                   sram, M, paper, standard, reference, computed, bwd_computed, compulsory,
                   tuple(assumptions))


# --------------------------------------------------------------------------- text tables


def format_table(header, rows) -> str:
    """A plain-text table: left-aligned text, right-aligned numbers."""
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def numeric(c):
        return c.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()

    def line(cells):
        return "  ".join(c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line([str(h) for h in header]), sep] + [line(r) for r in rows])


# --------------------------------------------------------------------------- context parallelism

# Assumed rates of the overlap model (override per call): the 16-bit kernels' measured throughput
# on the H200 at d = 128, 16k tokens (docs/performance.md: forward 683-711, backward 553-562
# TFLOP/s), NVLink 4 at 450 GB/s per direction of which a ring's send and receive each reach
# about 400, and the HBM bandwidth the merge streams at (copy ceiling, 4.28 TB/s measured).
CP_TFLOPS_FWD = 680.0
CP_TFLOPS_BWD = 550.0
CP_LINK_GBPS = 400.0
CP_HBM_GBPS = 4280.0


@dataclass(frozen=True)
class ContextParallelStep:
    """One step of the ring (the slowest rank's compute; every rank sends one block)."""

    step: int
    flops: int  # the busiest rank's FLOPs in this step
    bytes_sent: int  # per rank
    compute_s: float
    transfer_s: float

    @property
    def time_s(self) -> float:
        """Compute and transfer overlap: the step takes the longer of the two."""
        return max(self.compute_s, self.transfer_s)


@dataclass(frozen=True)
class ContextParallelModel:
    """Per-rank FLOPs, bytes per step and the overlap model of one pass (cuflash.distributed)."""

    world: int
    mode: str
    balance: str
    pass_: str
    seq_len: int
    rank_flops: tuple  # per rank, the whole pass
    steps: tuple  # ContextParallelStep (ring) or one entry per phase (all-gather)
    serial_flops: int  # the single-device pass's exact FLOPs
    tflops: float
    link_gbps: float
    notes: tuple = ()

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    @property
    def single_device_s(self) -> float:
        return self.serial_flops / (self.tflops * 1e12)

    @property
    def speedup(self) -> float:
        return self.single_device_s / self.time_s if self.time_s else float("inf")

    @property
    def efficiency(self) -> float:
        return self.speedup / self.world

    def table(self) -> str:
        rows = [(s.step, f"{s.flops:,}", f"{s.bytes_sent:,}", f"{s.compute_s * 1e3:.3f}", f"{s.transfer_s * 1e3:.3f}",
                 "compute" if s.compute_s >= s.transfer_s else "transfer") for s in self.steps]
        return format_table(("step", "busiest rank FLOPs", "bytes sent / rank", "compute ms", "transfer ms",
                             "bound by"), rows)


def _chunk_pairs(causal, qa, qb, ka, kb):
    """Visible (query, key) pairs between global rows [qa, qb) and [ka, kb) of one sequence."""
    if qb <= qa or kb <= ka:
        return 0
    if not causal:
        return (qb - qa) * (kb - ka)
    # row i sees keys [ka, min(kb, i + 1)): i + 1 - ka of them for ka <= i < kb - 1, all from kb - 1 on
    lo, hi = max(qa, ka), max(max(qa, ka), min(qb, kb - 1))
    partial = (hi - ka) * (hi - ka + 1) // 2 - (lo - ka) * (lo - ka + 1) // 2
    full = max(0, qb - max(qa, kb - 1)) * (kb - ka)
    return partial + full


def context_parallel(q_shape, world, *, hkv=None, causal=False, dtype=None, mode="ring", balance="zigzag",
                     pass_="fwd", tflops=None, link_gbps=CP_LINK_GBPS, hbm_gbps=CP_HBM_GBPS) -> ContextParallelModel:
    """The model of ``cuflash.distributed.ring_attention`` over a whole sequence of ``q_shape``
    (B, Hq, N, d) on ``world`` ranks: each rank's FLOPs, the bytes each rank sends per step, and
    per step the compute time (the busiest rank at ``tflops``, plus the float32 merge of its
    partial o at ``hbm_gbps``) against the transfer time at ``link_gbps`` (GB/s per direction).

    Ring (``mode="ring"``): step s computes this rank's rows against the block of rank r - s while
    the next block is sent, so a step takes max(compute, transfer). Forward sends K and V
    (``dtype``); backward also dK and dV (float32). All-gather: the K/V all-gather (forward and
    backward) and the backward's dK/dV all-reduce (float32, 2 (P-1)/P of it) are not overlapped.
    ``tflops`` defaults to the 16-bit kernels' measured H200 rates (CP_TFLOPS_FWD / _BWD)."""
    _check_choice("mode", mode, ("ring", "allgather"))
    _check_choice("balance", balance, sequence_split.BALANCES)
    _check_choice("pass_", pass_, ("fwd", "bwd"))
    if len(q_shape) != 4:
        raise ValueError(f"q_shape: expected (B, Hq, N, d), got {q_shape}")
    b, hq, n, d = (_check_int("q_shape", x, minimum=1) for x in q_shape)
    world = _check_int("world", world, minimum=1)
    hkv = hq if hkv is None else _check_int("hkv", hkv, minimum=1)
    _check_heads(hq, hkv)
    dt = _check_dtype("dtype", dtype if dtype is not None else BFLOAT16)
    causal = bool(masks.normalize_causal(causal))
    per_pair = 4 if pass_ == "fwd" else 10
    rate = tflops if tflops is not None else (CP_TFLOPS_FWD if pass_ == "fwd" else CP_TFLOPS_BWD)
    if not (rate > 0 and link_gbps > 0 and hbm_gbps > 0):
        raise ValueError("tflops, link_gbps, hbm_gbps: expected positive rates")
    chunks = [[(lo, hi) for _, lo, hi in cs] for cs in sequence_split.chunk_bounds(n, world, balance)]
    lens = [sum(e - s for s, e in cs) for cs in chunks]
    unit = per_pair * b * hq * d  # FLOPs per visible pair
    serial = unit * _chunk_pairs(causal, 0, n, 0, n)
    kv_elems = 2 * b * hkv * d  # K and V per sequence row
    steps, rank_flops, notes = [], [0] * world, []
    if mode == "ring":
        for s in range(world):
            flops, merge_bytes = [], 0
            for r in range(world):
                src = (r - s) % world
                pairs = sum(_chunk_pairs(causal, qa, qb, ka, kb) for qa, qb in chunks[r] for ka, kb in chunks[src])
                flops.append(unit * pairs)
                rank_flops[r] += unit * pairs
            busiest = max(flops)
            # the merge of this step's float32 partial o into the running one: read two, write one
            merge_bytes = 3 * b * hq * max(lens) * d * 4 if (s > 0 and pass_ == "fwd") else 0
            # K, V on to the next rank but after the last step; the backward's float32 dK, dV every step
            # (after the last one they return to their owner, overlapping nothing: counted in that step)
            sent = 0
            if world > 1:
                sent = (kv_elems * max(lens) * dt.itemsize if s < world - 1 else 0) + \
                    (kv_elems * max(lens) * 4 if pass_ == "bwd" else 0)
            steps.append(ContextParallelStep(s, busiest, sent, busiest / (rate * 1e12) + merge_bytes / (hbm_gbps * 1e9),
                                             sent / (link_gbps * 1e9)))
        notes.append("ring: each step's transfer overlaps its compute; a step lasts the longer of the two")
    else:
        for r in range(world):
            rank_flops[r] = unit * sum(_chunk_pairs(causal, qa, qb, 0, n) for qa, qb in chunks[r])
        gathered = kv_elems * n * dt.itemsize * (world - 1) // world
        steps.append(ContextParallelStep(0, 0, gathered, 0.0, gathered / (link_gbps * 1e9)))
        steps.append(ContextParallelStep(1, max(rank_flops), 0, max(rank_flops) / (rate * 1e12), 0.0))
        if pass_ == "bwd":
            reduced = 2 * kv_elems * n * 4 * (world - 1) // world
            steps.append(ContextParallelStep(2, 0, reduced, 0.0, reduced / (link_gbps * 1e9)))
        notes.append("all-gather: step 0 gathers K/V, step 1 computes, (backward) step 2 all-reduces dK/dV; "
                     "not overlapped")
    notes.append(f"assumed rates: {rate:g} TFLOP/s, link {link_gbps:g} GB/s per direction, HBM {hbm_gbps:g} GB/s")
    return ContextParallelModel(world, mode, balance, pass_, n, tuple(rank_flops), tuple(steps), serial, rate,
                                link_gbps, tuple(notes))
