"""The visibility mask written straight from the documented definitions, one pair at a time.

Shared by the accounting and the window/varlen tests, so that both hold cuflash.masks to the same
independent brute force: query i (of nq) sees key j (of nk) iff j <= diag when causal and
diag - left <= j <= diag + right under a window (a side of -1 is unbounded), where diag = i for
causal="top_left" and i + nk - nq otherwise (bottom-right, FlashAttention's alignment)."""

import numpy as np

from cuflash import masks


def brute_visible(causal, window, nq, nk):
    """(nq, nk) boolean mask, one pair at a time."""
    causal = masks.normalize_causal(causal)
    vis = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        diag = i if causal == "top_left" else i + nk - nq
        for j in range(nk):
            ok = True
            if causal is not None:
                ok = ok and j <= diag
            if window is not None:
                left, right = window
                if left >= 0:
                    ok = ok and j >= diag - left
                if right >= 0:
                    ok = ok and j <= diag + right
            vis[i, j] = ok
    return vis
