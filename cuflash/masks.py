"""Mask semantics shared by every backend, the reference and the accounting.

Query row i (0-based, of Nq) may see key column j (of Nk) when j <= i + offset, where

* ``"bottom_right"`` (FlashAttention >= 2.1, and ``causal=True``): offset = Nk - Nq, so the last
  query sees every key — the convention for decoding with a cache;
* ``"top_left"`` (torch SDPA's ``is_causal``): offset = 0.

A row that sees no key (possible when Nq > Nk with bottom-right alignment) yields o = 0, lse = -inf.
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


def visible_keys_per_row(causal, nq: int, nk: int) -> np.ndarray:
    """Number of keys each query row sees, as int64 array of length nq."""
    off = causal_offset(causal, nq, nk)
    if off is None:
        return np.full(nq, nk, dtype=np.int64)
    return np.clip(np.arange(nq, dtype=np.int64) + off + 1, 0, nk)


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


def mask_matrix(xp, causal, nq: int, nk: int):
    """Boolean (nq, nk) visibility matrix; only for the materializing reference and tests."""
    off = causal_offset(causal, nq, nk)
    if off is None:
        return xp.ones((nq, nk), dtype=bool)
    i = xp.arange(nq)[:, None]
    j = xp.arange(nk)[None, :]
    return j <= i + off


def tile_is_visible(causal, nq, nk, row0, row1, col0) -> bool:
    """Does any query in rows [row0, row1) see any key at or after col0? (skip fully masked tiles)"""
    if col0 >= nk or row1 <= row0:
        return False
    off = causal_offset(causal, nq, nk)
    return off is None or col0 <= row1 - 1 + off


def tile_needs_mask(causal, nq, nk, row0, col0, col1) -> bool:
    """Must the tile rows>=row0 x cols [col0, col1) apply the causal or the length mask?"""
    if col1 > nk:
        return True
    off = causal_offset(causal, nq, nk)
    return off is not None and col1 - 1 > row0 + off
