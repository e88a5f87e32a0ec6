"""The visibility mask written straight from the documented definitions, one pair at a time.

Shared by the accounting and the window/varlen tests, so that both hold cuflash.core.masks to the same
independent brute force: query i (of nq) sees key j (of nk) iff j <= diag when causal and
diag - left <= j <= diag + right under a window (a side of -1 is unbounded), where diag = i for
causal="top_left" and i + nk - nq otherwise (bottom-right, FlashAttention's alignment)."""

import numpy as np

from cuflash.core import masks
from cuflash.testing import random_inputs


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


def packed_batch(rng, dtype, nqs, nks, hq=4, hkv=2, d=16):
    """Random packed q (total_q, hq, d), k, v (total_k, hkv, d) and the int32 offsets of
    sequences with nqs[b] queries and nks[b] keys."""
    cq = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(nks)]).astype(np.int32)
    q, k, v = random_inputs(rng, (int(cq[-1]), hq, d), (int(ck[-1]), hkv, d), dtype)
    return q, k, v, cq, ck


def block_diagonal_mask(causal, window, cq, ck):
    """The packed problem's mask: sequence b's rows see only its own keys, by brute force."""
    vis = np.zeros((int(cq[-1]), int(ck[-1])), dtype=bool)
    for b in range(len(cq) - 1):
        vis[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = brute_visible(causal, window, int(cq[b + 1] - cq[b]),
                                                              int(ck[b + 1] - ck[b]))
    return vis
