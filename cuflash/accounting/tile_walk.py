"""The tiles a schedule visits under a mask (counted tile by tile, bisecting the visible prefix or
suffix), and FlashAttention's Theorem 2 traffic bound beside them."""

from __future__ import annotations

from ..core import masks


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
    """Keys in the visible K/V tiles of query rows [row0, row1)."""
    return min(nk, visible_key_tiles(causal, nq, nk, row0, row1, bn) * bn)


def visible_query_rows(causal, nq, nk, col0, bm):
    """Query rows in the query tiles that see K/V tile starting at col0: a suffix of the tiles."""
    m_tiles = -(-nq // bm)
    first = _bisect_first(0, m_tiles, lambda t: masks.tile_is_visible(causal, nq, nk, t * bm, min(nq, (t + 1) * bm), col0))
    return nq - min(nq, first * bm)


def kv_tile_reads(causal, nq, nk, bm, bn):
    """(keys loaded, pairs computed) summed over the query tiles of one head, tile by tile."""
    keys = pairs = 0
    for row0 in range(0, nq, bm):
        row1 = min(nq, row0 + bm)
        cols = _visible_key_columns(causal, nq, nk, row0, row1, bn)
        keys += cols
        pairs += (row1 - row0) * cols
    return keys, pairs


def visible_key_tiles(causal, nq, nk, row0, row1, bn):
    """K/V tiles (of bn keys) that query rows [row0, row1) see: masks.tile_is_visible holds for a
    prefix of the row's tiles, so bisect for the first invisible one."""
    n_tiles = -(-nk // bn)
    return _bisect_first(0, n_tiles, lambda t: not masks.tile_is_visible(causal, nq, nk, row0, row1, t * bn))


def paper_bound(assumptions, passes_bh, nq, nk, d, M, sram, itemsize, default_sram):
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
