"""cuflash.merge_attention_states: the exact log-sum-exp merge of partial attention results."""

from __future__ import annotations

import numpy as np

from ..backends import cuda
from ..backends import numpy as numpy_backend
from ..core import problem as _problem
from ..core.layout import is_view_of
from ..core.merge import validate_merge
from . import interop


def merge_attention_states(o_parts, lse_parts, *, layout="bhsd", dtype=None, out=None, lse_out=None):
    """Merge attention results computed over disjoint sets of keys into the result over their union.

    ``o_parts`` (P, ...) and ``lse_parts`` (P, ...) stack, along a new leading parts axis, P >= 1
    results of :func:`attention` for the same queries over disjoint key sets (e.g. a long sequence
    cut into slices: context parallelism, split KV): each part's o, shaped as ``attention`` returns
    it for ``layout`` ((..., H, N, d), (..., N, H, d) or (N, d)), and its lse as
    ``attention(..., return_lse=True)`` returns it ((..., H, N) float32, (N,) for a 2-D o). A
    list or tuple of P arrays is stacked first (one copy).

    lse is the natural-log log-sum-exp of a row's scaled, masked scores over the keys the part
    saw, ``lse_i = log sum_j exp(scale * q_i . k_j)``, -inf for a row that saw no key. The merge is
    exact: with ``m = max_p lse_p`` and ``w_p = exp(lse_p - m)``,
    ``o = sum_p w_p o_p / sum_p w_p`` and ``lse = m + log sum_p w_p``, computed in float32 for
    16-bit parts and float64 for float32 parts, rounded once. A part whose lse is -inf does not
    count (whatever its o holds); a row no part saw gets o = 0 and lse = -inf, as ``attention``
    gives a row that sees no key. Partial outputs keep more precision with
    ``attention(..., out_dtype=numpy.float32)``.

    ``dtype``: the merged o's dtype (float16, bfloat16 or float32), default the parts' dtype.
    ``out``, ``lse_out``: optional arrays (o's shape and ``dtype``; lse's shape, float32) to write
    the results into, overlapping neither the inputs nor each other.

    Returns (o, lse). NumPy arrays merge on the CPU, CuPy arrays on their GPU (one kernel on the
    current stream); other array kinds as for ``attention``.
    """
    if isinstance(o_parts, (list, tuple)) or isinstance(lse_parts, (list, tuple)):
        _, o_parts, lse_parts = validate_merge(o_parts, lse_parts, layout=layout, dtype=dtype)  # stacks them
    return _merge(o_parts, lse_parts, layout=layout, dtype=dtype, out=out, lse_out=lse_out)


@interop.accepts_foreign_arrays("o_parts", "lse_parts", outputs=("out", "lse_out"))
def _merge(o_parts, lse_parts, *, layout="bhsd", dtype=None, out=None, lse_out=None):
    mp, o_parts, lse_parts = validate_merge(o_parts, lse_parts, layout=layout, dtype=dtype, out=out,
                                            lse_out=lse_out)
    xp = mp.xp
    if xp is not np:
        _problem.warn_if_capture_unsafe()
    o = out if out is not None else xp.empty(mp.o_shape(), dtype=mp.out_dtype)
    lse = lse_out if lse_out is not None else xp.empty(mp.lse_shape(), dtype=np.float32)
    o5, lse4 = mp.o5(o_parts), mp.lse4(lse_parts)
    # The outputs' canonical views; a scratch array where out's strides do not merge (copied in after).
    o4, lse3 = mp.o5(o[None])[0], mp.lse4(lse[None])[0]
    o_direct, lse_direct = is_view_of(o4, o), is_view_of(lse3, lse)
    if not o_direct:
        o4 = xp.empty((mp.batch, mp.heads, mp.n, mp.d), dtype=mp.out_dtype)
    if not lse_direct:
        lse3 = xp.empty((mp.batch, mp.heads, mp.n), dtype=np.float32)
    (numpy_backend if xp is np else cuda).merge(o5, lse4, o4, lse3)
    if not o_direct:
        o[...] = _from5(mp, o4)
    if not lse_direct:
        lse[...] = lse3.reshape(mp.lse_shape())
    return o, lse


def _from5(mp, o4):
    """(B, H, N, d) -> the layout's o shape."""
    if mp.single_head:
        return o4[0, 0]
    if mp.layout == "bhsd":
        return o4.reshape(mp.o_shape())
    return o4.swapaxes(1, 2).reshape(mp.o_shape())
