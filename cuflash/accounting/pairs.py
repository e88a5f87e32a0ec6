"""Exact visible (query, key) pair counts: one head's in closed form, and the per-sequence lengths
of a call (dense, varlen, kv_lens) they are summed over."""

from __future__ import annotations

import math
from collections import Counter

from ..core import masks
from ..core.problem import check_offset_values
from .arguments import LAYOUTS, check_choice, check_heads, check_shape, int_list, split_heads


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


def sequence_lengths(q_shape, k_shape, layout, kv_lens, cu_seqlens_q, cu_seqlens_k):
    """(batch, hq, hkv, d, Counter of (nq_b, nk_b) per sequence) after checking every argument."""
    q_shape = check_shape("q_shape", q_shape)
    k_shape = check_shape("k_shape", k_shape)
    check_choice("layout", layout, LAYOUTS)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
            raise ValueError(f"{missing}: varlen needs both cu_seqlens_q and cu_seqlens_k")
        for name, s in (("q_shape", q_shape), ("k_shape", k_shape)):
            if len(s) != 3:
                raise ValueError(f"{name}: with cu_seqlens expected packed (total, H, d), got {s}")
        (tq, hq, d), (tk, hkv, dk) = q_shape, k_shape
        cq, ck = int_list("cu_seqlens_q", cu_seqlens_q), int_list("cu_seqlens_k", cu_seqlens_k)
        for name, c, total in (("cu_seqlens_q", cq, tq), ("cu_seqlens_k", ck, tk)):
            check_offset_values(name, c, total, "q_shape[0]" if name == "cu_seqlens_q" else "k_shape[0]")
        if len(cq) != len(ck):
            raise ValueError(f"cu_seqlens_k: {len(ck) - 1} sequences, cu_seqlens_q has {len(cq) - 1}")
        batch = len(cq) - 1
        nqs = [b - a for a, b in zip(cq, cq[1:])]
        nks = [b - a for a, b in zip(ck, ck[1:])]
    else:
        qb, hq, nq, d = split_heads("q_shape", q_shape, layout)
        kb, hkv, nk, dk = split_heads("k_shape", k_shape, layout)
        if len(q_shape) != len(k_shape) or qb != kb:
            raise ValueError(f"k_shape: batch dimensions {kb} must equal q_shape's {qb}")
        batch = math.prod(qb)
        nqs, nks = [nq] * batch, [nk] * batch
    if dk != d:
        raise ValueError(f"k_shape: head dim {dk} must equal q_shape's head dim {d}")
    if d == 0:
        raise ValueError("q_shape: head dim d must be at least 1")
    check_heads(hq, hkv, "k_shape")
    if kv_lens is not None:
        lens = int_list("kv_lens", kv_lens)
        if len(lens) != batch:
            raise ValueError(f"kv_lens: expected one length per sequence ({batch}), got {len(lens)}")
        for b, (n, cap) in enumerate(zip(lens, nks)):
            if n > cap:
                raise ValueError(f"kv_lens[{b}]: {n} is longer than the {cap} keys stored")
        nks = lens
    return batch, hq, hkv, d, Counter(zip(nqs, nks))
