"""The context-parallel model (cuflash.accounting.context_parallel) and `cuflash report
--context-parallel P`: counts checked against direct enumeration and hand formulas."""

import numpy as np
import pytest

from cuflash import accounting
from cuflash.core.sequence_split import chunk_bounds
from cuflash.cli import report


def _pairs_by_enumeration(n, world, rank, src, causal, balance="zigzag"):
    chunks = chunk_bounds(n, world, balance)
    vis = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    rows = np.concatenate([np.arange(a, b) for _, a, b in chunks[rank]])
    cols = np.concatenate([np.arange(a, b) for _, a, b in chunks[src]])
    return int(vis[np.ix_(rows, cols)].sum())


@pytest.mark.parametrize("n,world", [(37, 3), (64, 4), (9, 4), (50, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_flops_by_enumeration(n, world, causal):
    b, hq, d = 2, 4, 16
    for pass_, per_pair in (("fwd", 4), ("bwd", 10)):
        m = accounting.context_parallel((b, hq, n, d), world, hkv=2, causal=causal, pass_=pass_)
        for r in range(world):
            want = sum(_pairs_by_enumeration(n, world, r, s, causal) for s in range(world))
            assert m.rank_flops[r] == per_pair * b * hq * d * want
        assert sum(m.rank_flops) == m.serial_flops == accounting.flops((b, hq, n, d), (b, 2, n, d),
                                                                        causal=causal, pass_=pass_).flops
        for s, step in enumerate(m.steps):
            assert step.flops == max(per_pair * b * hq * d * _pairs_by_enumeration(n, world, r, (r - s) % world, causal)
                                     for r in range(world))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    z = accounting.context_parallel((1, 8, 4096, 128), 4, causal=True)
    c = accounting.context_parallel((1, 8, 4096, 128), 4, causal=True, balance="contiguous")
    assert len(set(z.rank_flops)) == 1
    assert max(c.rank_flops) > 1.7 * min(c.rank_flops[1:]) and c.rank_flops[0] < c.rank_flops[-1]
    assert z.time_s < c.time_s


def test_bytes_and_times_per_step():
    b, hq, hkv, n, d, world = 1, 32, 8, 131072, 128, 4
    m = accounting.context_parallel((b, hq, n, d), world, hkv=hkv, causal=True, dtype="bfloat16", link_gbps=400.0)
    kv = 2 * b * hkv * (n // world) * d
    assert [s.bytes_sent for s in m.steps] == [kv * 2] * (world - 1) + [0]
    assert m.steps[0].transfer_s == pytest.approx(kv * 2 / 400e9)
    assert m.steps[1].compute_s == pytest.approx(m.steps[1].flops / 680e12 + 3 * b * hq * (n // world) * d * 4 / 4280e9)
    assert m.time_s == pytest.approx(sum(max(s.compute_s, s.transfer_s) for s in m.steps))
    bwd = accounting.context_parallel((b, hq, n, d), world, hkv=hkv, causal=True, pass_="bwd")
    assert [s.bytes_sent for s in bwd.steps] == [kv * 2 + kv * 4] * (world - 1) + [kv * 4]
    # a slow link makes the steps transfer-bound
    slow = accounting.context_parallel((b, hq, 8192, d), world, hkv=hkv, link_gbps=0.5)
    assert all(s.transfer_s > s.compute_s for s in slow.steps[:-1])
    ag = accounting.context_parallel((b, hq, n, d), world, hkv=hkv, causal=True, mode="allgather", pass_="bwd")
    full_kv = 2 * b * hkv * n * d
    assert [s.bytes_sent for s in ag.steps] == [full_kv * 2 * 3 // 4, 0, full_kv * 4 * 2 * 3 // 4]
    with pytest.raises(ValueError, match="mode"):
        accounting.context_parallel((b, hq, n, d), world, mode="tree")


def test_report_cli(capsys):
    assert report.main(["--shape", "1,32,131072,128", "--hkv", "8", "--causal", "--context-parallel", "4"]) == 0
    out = capsys.readouterr().out
    assert "mode=allgather" in out and "== predicted scaling ==" in out and "per-rank FLOPs" in out
    assert report.main(["--shape", "1,8,65536,128", "--causal", "--context-parallel", "2", "--cp-mode", "ring",
                        "--link-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "mode=ring" in out and "bytes sent / rank" in out and "link 100 GB/s" in out
