"""tools/trace_stats.py, the analysis behind tools/bwd_trace.py and tools/fwd_trace.py, on
synthetic trace rows whose answer is known (no GPU)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from trace_stats import summarize  # noqa: E402


def _rows(fixed_ns, per_item_ns, gap_ns, sms=4, blocks=6, seed=0):
    """Blocks back to back on each SM (gap_ns between), each fixed + per_item x its work."""
    rng = np.random.default_rng(seed)
    rows = []
    for sm in range(sms):
        t = 1000 * sm
        for _ in range(blocks):
            work = int(rng.integers(1, 12))
            dur = fixed_ns + per_item_ns * work
            rows.append([t, t + dur, sm, work])
            t += dur + gap_ns
    return np.array(rows, dtype=np.uint64)


def test_fit_recovers_fixed_and_per_item_cost(capsys):
    rows = _rows(2500, 3100, 0)
    out = summarize(np.vstack([rows, np.zeros((5, 4), np.uint64)]), "CELL", "key_tile")  # unwritten rows dropped
    assert out["blocks"] == len(rows) and out["sms"] == 4
    assert out["fit_fixed_us"] == pytest.approx(2.5, abs=1e-6)
    assert out["fit_per_key_tile_us"] == pytest.approx(3.1, abs=1e-6)
    assert sum(v["blocks"] for v in out["by_key_tiles"].values()) == len(rows)
    assert "CELL span" in capsys.readouterr().out


def test_idle_between_and_after():
    # 2 SMs: SM 0 runs 10 + 10 us with a 5 us gap, SM 1 one 10 us block: span 25 us, idle between
    # 5 us (SM 0) + 0, idle after the last block 0 (SM 0) + 15 us (SM 1), of 50 SM-us.
    rows = np.array([[0, 10_000, 0, 1], [15_000, 25_000, 0, 1], [0, 10_000, 1, 1]], dtype=np.uint64)
    out = summarize(rows, "CELL", "step")
    assert out["span_us"] == pytest.approx(25)
    assert out["idle_between_blocks_pct"] == pytest.approx(100 * 5 / 50)
    assert out["idle_after_last_block_pct"] == pytest.approx(100 * 15 / 50)


def test_no_rows_is_reported_not_raised(capsys):
    assert summarize(np.zeros((3, 4), np.uint64), "CELL", "step") == {}
    assert "no trace rows" in capsys.readouterr().out
