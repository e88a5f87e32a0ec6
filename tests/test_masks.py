"""Mask semantics: closed forms and tile predicates against brute force over the mask matrix."""

import numpy as np
import pytest

from cuflash.core import masks

MODES = (None, "bottom_right", "top_left")


def brute_mask(causal, nq, nk):
    """Visibility by the definition, one pair at a time: key j visible to query i iff j <= i + offset."""
    off = {None: None, "bottom_right": nk - nq, "top_left": 0}[causal]
    vis = np.zeros((nq, nk), dtype=bool)
    for i in range(nq):
        for j in range(nk):
            vis[i, j] = off is None or j <= i + off
    return vis


def series_pair_count(causal, nq, nk):
    """sum_i clip(i + off + 1, 0, nk) by splitting rows into (none, partial, full), in Python ints."""
    if causal is None:
        return nq * nk
    off = nk - nq if causal == "bottom_right" else 0
    total = 0
    first_partial = min(nq, max(0, -off))  # rows before this see no key
    first_full = min(nq, max(first_partial, nk - off - 1))  # rows from here see all nk keys
    n = first_full - first_partial  # rows seeing i + off + 1 keys: an arithmetic series
    if n > 0:
        a = first_partial + off + 1
        total += n * a + n * (n - 1) // 2
    return total + (nq - first_full) * nk


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("nq", [0, 1, 2, 3, 7, 16, 17])
@pytest.mark.parametrize("nk", [0, 1, 2, 5, 16, 19])
def test_pair_count_and_rows_match_brute_force(causal, nq, nk):
    vis = brute_mask(causal, nq, nk)
    assert np.array_equal(masks.mask_matrix(np, causal, nq, nk), vis)
    assert masks.pair_count(causal, nq, nk) == int(vis.sum())
    rows = masks.visible_keys_per_row(causal, nq, nk)
    assert rows.dtype == np.int64 and rows.shape == (nq,)
    assert np.array_equal(rows, vis.sum(axis=1))


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_pair_count_random_shapes(causal, seed):
    rng = np.random.default_rng(1000 + seed)
    for nq, nk in rng.integers(0, 300, size=(25, 2)):
        nq, nk = int(nq), int(nk)
        assert masks.pair_count(causal, nq, nk) == int(masks.mask_matrix(np, causal, nq, nk).sum())


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize(
    "nq, nk",
    [(2**40, 2**40), (2**40 + 3, 2**20), (5, 2**50), (2**50, 7), (10**15, 10**15 - 1), (1, 10**18), (10**18, 1)],
)
def test_pair_count_huge_is_exact(causal, nq, nk):
    got = masks.pair_count(causal, nq, nk)
    assert isinstance(got, int)
    assert got == series_pair_count(causal, nq, nk)


def test_pair_count_known_closed_forms():
    n = 10**12 + 7
    assert masks.pair_count("bottom_right", n, n) == n * (n + 1) // 2
    assert masks.pair_count("top_left", n, n) == n * (n + 1) // 2
    assert masks.pair_count("top_left", n, 3 * n) == n * (n + 1) // 2
    assert masks.pair_count("bottom_right", 1, n) == n  # one decoding query sees the whole cache
    assert masks.pair_count("top_left", 1, n) == 1
    assert masks.pair_count(None, n, 3) == 3 * n


def test_series_helper_agrees_with_brute_force():
    # The independent formula used above for huge shapes is itself checked on small ones.
    for causal in MODES:
        for nq in range(0, 9):
            for nk in range(0, 9):
                assert series_pair_count(causal, nq, nk) == int(brute_mask(causal, nq, nk).sum())


@pytest.mark.parametrize("causal", MODES)
@pytest.mark.parametrize("nq, nk", [(1, 1), (5, 3), (3, 5), (8, 8), (9, 4), (4, 13), (12, 12), (13, 0), (0, 6)])
def test_tile_predicates_match_brute_force(causal, nq, nk):
    vis = brute_mask(causal, nq, nk)
    for row0 in range(nq):
        for row1 in range(row0 + 1, nq + 1):
            for col0 in range(nk + 3):
                want = bool(vis[row0:row1, col0:].any())
                assert masks.tile_is_visible(causal, nq, nk, row0, row1, col0) == want, (row0, row1, col0)
                for col1 in range(col0 + 1, nk + 4):
                    # A tile needs the mask when some (row, col) in it is not visible; columns past
                    # nk are never visible (they hold zero-filled keys that must become -inf).
                    tile = np.zeros((row1 - row0, col1 - col0), dtype=bool)
                    inside = max(0, min(col1, nk) - col0)
                    tile[:, :inside] = vis[row0:row1, col0:col0 + inside]
                    want_mask = not bool(tile.all())
                    got = masks.tile_needs_mask(causal, nq, nk, row0, col0, col1)
                    assert got == want_mask, (row0, row1, col0, col1)


def test_tile_is_visible_empty_rows():
    assert not masks.tile_is_visible(None, 4, 4, 2, 2, 0)


@pytest.mark.parametrize("value, want", [
    (False, None), (None, None), (True, "bottom_right"), ("bottom_right", "bottom_right"), ("top_left", "top_left"),
])
def test_normalize_causal(value, want):
    assert masks.normalize_causal(value) == want


@pytest.mark.parametrize("value", ["TOP_LEFT", "causal", 1, 0, 1.0, "", "bottom-right"])
def test_normalize_causal_rejects(value):
    with pytest.raises(ValueError, match="causal"):
        masks.normalize_causal(value)
