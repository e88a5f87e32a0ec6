"""The sequence's cut over ranks (cuflash.core.sequence_split), against hand-written cases."""

import pytest

from cuflash.core.sequence_split import chunk_bounds, pick_mode, relation


def test_zigzag_and_contiguous_chunks_by_hand():
    # 10 rows, 2 ranks: zigzag cuts 4 chunks at 0, 2, 5, 7, 10; rank 0 holds chunks 0 and 3
    assert chunk_bounds(10, 2) == [[(0, 0, 2), (3, 7, 10)], [(1, 2, 5), (2, 5, 7)]]
    assert chunk_bounds(10, 2, "contiguous") == [[(0, 0, 5)], [(1, 5, 10)]]
    bounds = chunk_bounds(3, 2)
    assert bounds == [[(0, 0, 0), (3, 2, 3)], [(1, 0, 1), (2, 1, 2)]]  # floor(c * 3 / 4): an empty first chunk


@pytest.mark.parametrize("n,world", [(1, 1), (7, 3), (64, 4), (5, 8)])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_chunks_tile_the_sequence_once(n, world, balance):
    rows = sorted(r for cs in chunk_bounds(n, world, balance) for _, a, b in cs for r in range(a, b))
    assert rows == list(range(n))


def test_relation_and_mode():
    assert [relation(True, 2, k) for k in (1, 2, 3)] == ["full", "causal", None]
    assert [relation(False, 2, k) for k in (1, 2, 3)] == ["full"] * 3
    assert pick_mode(32, 8, 4) == "allgather" and pick_mode(32, 8, 8) == "ring"
    with pytest.raises(ValueError, match="balance"):
        chunk_bounds(8, 2, "striped")
