"""Mask semantics shared by every backend, the reference and the accounting.

Query row i (0-based, of Nq) may see key column j (of Nk) when j <= i + offset, where

* ``"bottom_right"`` (FlashAttention >= 2.1, and ``causal=True``): offset = Nk - Nq, so the last
  query sees every key — the convention for decoding with a cache;
* ``"top_left"`` (torch SDPA's ``is_causal``): offset = 0.

A sliding window ``window=(left, right)`` (FlashAttention's) further restricts row i to the keys
[diag - left, diag + right] around its diagonal diag = i + offset (causal) or i + Nk - Nq (not
causal: bottom-right, as FlashAttention aligns it); -1 leaves that side unbounded, and with causal
the right end is the smaller of the two bounds. :func:`row_bounds` is the one definition that the
backends, the reference and the accounting use.

A row that sees no key (possible when Nq > Nk with bottom-right alignment, or under a window) yields
o = 0, lse = -inf.
"""

from __future__ import annotations

import numpy as np

CAUSAL_MODES = (None, "bottom_right", "top_left")


def normalize_causal(causal):
    """Map the public ``causal=`` argument to None, "bottom_right" or "top_left"."""
    if causal is None or causal is False:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str) and causal in ("bottom_right", "top_left"):
        return causal
    raise ValueError(
        f"causal: expected False, True, 'bottom_right' or 'top_left', got {causal!r}"
    )


def causal_offset(causal, nq: int, nk: int) -> int | None:
    """The diagonal offset: key j is visible to query i iff j <= i + offset. None when not causal."""
    if causal is None:
        return None
    return nk - nq if causal == "bottom_right" else 0


def normalize_window(window):
    """Map the public ``window=`` argument to None (no window; also (-1, -1)) or a pair of ints."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window: expected None or a pair (left, right) of ints >= -1, got {window!r}")
    for i, w in enumerate(window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(
                f"window: expected a pair of ints (left, right), got window[{i}] of type {type(w).__name__}"
            )
        if w < -1:
            raise ValueError(f"window: expected values >= -1 (-1 = unbounded), got window[{i}] = {int(w)}")
    left, right = (int(w) for w in window)
    return None if (left, right) == (-1, -1) else (left, right)


def row_bounds(causal, window, nq, nk):
    """(lo, hi): key j is visible to query i iff i + lo <= j <= i + hi (then clipped to [0, nk)).

    None means unbounded on that side. The causal bound is j <= i + offset. A window (left, right)
    is aligned like FlashAttention's: on the diagonal i + Nk - Nq (or i for causal="top_left"),
    keys [diag - left, diag + right]; -1 leaves that side open. ``causal`` and ``window`` must be
    normalized (:func:`normalize_causal`, :func:`normalize_window`)."""
    off = causal_offset(causal, nq, nk)
    diag = off if off is not None else nk - nq
    lo, hi = None, off
    if window is not None:
        left, right = window
        if right >= 0:
            hi = diag + right if hi is None else min(hi, diag + right)
        if left >= 0:
            lo = diag - left
    return lo, hi


def visible_keys_per_row(causal, nq: int, nk: int, window=None) -> np.ndarray:
    """Number of keys each query row sees, as int64 array of length nq."""
    lo, hi = row_bounds(causal, window, nq, nk)
    i = np.arange(nq, dtype=np.int64)
    last = np.full(nq, nk - 1, dtype=np.int64) if hi is None else np.minimum(i + hi, nk - 1)
    first = np.zeros(nq, dtype=np.int64) if lo is None else np.maximum(i + lo, 0)
    return np.clip(last - first + 1, 0, nk)


def pair_count(causal, nq: int, nk: int) -> int:
    """Exact number of (query, key) pairs computed for one head: the dense work of the mask."""
    off = causal_offset(causal, nq, nk)
    if off is None:
        return nq * nk
    # Closed form of sum_i clip(i + off + 1, 0, nk), so it stays exact for huge N.
    lo = max(0, -off - 1 + 1)  # first row with at least one key: i + off + 1 >= 1
    total = 0
    # rows [lo, hi) see i + off + 1 keys (partial), rows [hi, nq) see all nk keys.
    hi = min(nq, max(lo, nk - off - 1))
    if hi > lo:
        first, last = lo + off + 1, hi - 1 + off + 1
        total += (first + last) * (hi - lo) // 2
    total += max(0, nq - max(hi, lo)) * nk if nk > 0 else 0
    return total


def visibility(xp, causal, nq: int, nk: int, row0, row1, col0, col1, window=None):
    """Boolean (row1 - row0, col1 - col0): which keys of columns [col0, col1) the query rows
    [row0, row1) see; columns at or past nk are never visible."""
    lo, hi = row_bounds(causal, window, nq, nk)
    i = xp.arange(row0, row1)[:, None]
    j = xp.arange(col0, col1)[None, :]
    vis = xp.ones((row1 - row0, col1 - col0), dtype=bool) & (j < nk)
    if hi is not None:
        vis = vis & (j <= i + hi)
    if lo is not None:
        vis = vis & (j >= i + lo)
    return vis


def mask_matrix(xp, causal, nq: int, nk: int, window=None):
    """Boolean (nq, nk) visibility matrix; only for the materializing reference and tests."""
    return visibility(xp, causal, nq, nk, 0, nq, 0, nk, window)


def key_range(causal, nq, nk, row0, row1, window=None):
    """[c0, c1): the keys that some query of rows [row0, row1) sees; c0 >= c1 when none does.

    Every row sees one interval [i + lo, i + hi] (hi >= lo) that moves by one key per row, so the
    rows' union is one interval too, clipped to [0, nk)."""
    if row1 <= row0:
        return 0, 0
    lo, hi = row_bounds(causal, window, nq, nk)
    c0 = 0 if lo is None else max(0, row0 + lo)
    c1 = nk if hi is None else min(nk, row1 + hi)
    return c0, c1


def tile_is_visible(causal, nq, nk, row0, row1, col0, window=None, col1=None) -> bool:
    """Does any query in rows [row0, row1) see any key in [col0, col1) (col1=None: to the end)?
    (skip fully masked tiles)"""
    if col0 >= nk or row1 <= row0:
        return False
    c0, c1 = key_range(causal, nq, nk, row0, row1, window)
    return max(c0, col0) < min(c1, nk if col1 is None else col1)


def tile_needs_mask(causal, nq, nk, row0, col0, col1, window=None, row1=None) -> bool:
    """Must the tile rows [row0, row1) x cols [col0, col1) apply the causal, window or length mask?

    ``row1`` is needed only for a window's left bound (the last row has the largest)."""
    if col1 > nk:
        return True
    lo, hi = row_bounds(causal, window, nq, nk)
    if hi is not None and col1 - 1 > row0 + hi:
        return True
    if lo is not None:
        if row1 is None:
            raise ValueError("row1: needed with a window that bounds the left side")
        return col0 < row1 - 1 + lo
    return False
