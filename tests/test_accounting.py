"""Honest accounting: pair counts against brute-force mask sums, FLOP formulas, exact memory bytes,
the tile-traffic model against a tile-by-tile enumeration, and the ``report`` command. CPU only."""

from __future__ import annotations

import re
import math

import types

import numpy as np
import pytest

import cuflash
from cuflash import accounting
from cuflash.core import masks
from cuflash.cli import report
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16
from cuflash.plan import decode as plan_decode

from _brute_mask import block_diagonal_mask, brute_visible

CAUSALS = (False, True, "bottom_right", "top_left")


# --------------------------------------------------------------------------- brute force


def brute_pairs(causal, window, nq, nk):
    return int(brute_visible(causal, window, nq, nk).sum())


def rowwise_pairs(causal, window, nq, nk):
    """Vectorized per-row visible counts (for mid-size N where the double loop is slow)."""
    causal = masks.normalize_causal(causal)
    i = np.arange(nq, dtype=np.int64)
    diag = i if causal == "top_left" else i + nk - nq
    hi = np.full(nq, nk - 1, dtype=np.int64)
    lo = np.zeros(nq, dtype=np.int64)
    if causal is not None:
        hi = np.minimum(hi, diag)
    if window is not None:
        if window[1] >= 0:
            hi = np.minimum(hi, diag + window[1])
        if window[0] >= 0:
            lo = np.maximum(lo, diag - window[0])
    return int(np.clip(hi - lo + 1, 0, None).sum())


# --------------------------------------------------------------------------- pair counts


@pytest.mark.parametrize("causal", CAUSALS)
def test_pairs_match_brute_force_small_shapes(causal):
    windows = [None, (-1, -1), (0, 0), (2, -1), (-1, 1), (1, 3), (4, 0), (0, 5)]
    for nq in range(0, 8):
        for nk in range(0, 8):
            for w in windows:
                got = accounting.pairs_per_head(causal, nq, nk, window=w)
                assert got == brute_pairs(causal, w, nq, nk), (causal, w, nq, nk)


def test_pairs_without_window_equal_mask_matrix_sum():
    for causal in CAUSALS:
        for nq, nk in [(1, 1), (5, 5), (3, 9), (9, 3), (17, 64), (64, 17)]:
            want = int(masks.mask_matrix(np, masks.normalize_causal(causal), nq, nk).sum())
            assert accounting.pairs_per_head(causal, nq, nk) == want == brute_pairs(causal, None, nq, nk)


def test_pairs_random_windows_mid_size(rng):
    for _ in range(40):
        nq, nk = (int(x) for x in rng.integers(1, 3000, size=2))
        w = (int(rng.integers(-1, 400)), int(rng.integers(-1, 400)))
        causal = CAUSALS[int(rng.integers(len(CAUSALS)))]
        got = accounting.pairs_per_head(causal, nq, nk, window=w)
        assert got == rowwise_pairs(causal, w, nq, nk), (causal, w, nq, nk)


def test_pairs_are_exact_python_ints_for_huge_n():
    n = 2**40
    f = cuflash.flops((4, 32, n, 128), (4, 32, n, 128), causal=True)
    assert f.pairs == 4 * 32 * (n * (n + 1) // 2)
    assert isinstance(f.pairs, int) and isinstance(f.flops, int)
    # A window bounded on both sides: every row sees at most left + 1 keys.
    f = cuflash.flops((1, 1, n, 64), (1, 1, n, 64), causal=True, window=(1023, 0))
    assert f.pairs == n * 1024 - (1023 * 1024) // 2


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("window", [None, (3, 0), (2, 2)])
def test_flops_kv_lens_is_a_per_sequence_sum(causal, window):
    b, h, nq, nk = 3, 2, 5, 7
    lens = [7, 3, 0]
    f = cuflash.flops((b, h, nq, 16), (b, 1, nk, 16), causal=causal, window=window, kv_lens=lens)
    want = h * sum(brute_pairs(causal, window, nq, L) for L in lens)
    assert f.pairs == want
    assert f.flops == 4 * want * 16
    # kv_lens as a NumPy array is the same.
    assert cuflash.flops((b, h, nq, 16), (b, 1, nk, 16), causal=causal, window=window,
                         kv_lens=np.array(lens)).pairs == want


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("window", [None, (1, 1)])
def test_flops_varlen_is_a_per_sequence_sum(causal, window):
    cq, ck = [0, 3, 3, 8, 9], [0, 4, 9, 9, 15]
    h, hkv, d = 4, 2, 8
    f = cuflash.flops((cq[-1], h, d), (ck[-1], hkv, d), causal=causal, window=window,
                      cu_seqlens_q=cq, cu_seqlens_k=ck, pass_="bwd")
    want = h * sum(brute_pairs(causal, window, cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(4))
    assert f.pairs == want
    assert f.flops == 10 * want * d
    # With kv_lens on top, each sequence sees its first kv_lens[b] keys.
    lens = [2, 5, 0, 1]
    g = cuflash.flops((cq[-1], h, d), (ck[-1], hkv, d), causal=causal, window=window,
                      cu_seqlens_q=cq, cu_seqlens_k=ck, kv_lens=lens)
    assert g.pairs == h * sum(brute_pairs(causal, window, cq[i + 1] - cq[i], lens[i]) for i in range(4))


@pytest.mark.parametrize("window", [None, (3, 0), (50, -1)])
def test_flops_of_packed_sequences_count_the_block_diagonal_pairs(window):
    # What any dtype's packed call computes (float8_e4m3fn GPU inputs' band kernel too: flops reads
    # shapes only): the pairs of the block-diagonal mask, empty sequences and all.
    nqs, nks = [1, 0, 2, 7, 16, 0, 300], [9, 4, 0, 3, 40, 0, 290]
    cq, ck = np.concatenate([[0], np.cumsum(nqs)]), np.concatenate([[0], np.cumsum(nks)])
    h, d = 4, 128
    f = cuflash.flops((int(cq[-1]), h, d), (int(ck[-1]), 2, d), causal=True, window=window, cu_seqlens_q=cq,
                      cu_seqlens_k=ck)
    assert f.pairs == h * int(block_diagonal_mask(True, window, cq, ck).sum())
    assert f.flops == 4 * f.pairs * d


def test_flops_layouts_and_single_head_agree():
    a = cuflash.flops((2, 3, 10, 8), (2, 3, 12, 8), causal=True)
    b = cuflash.flops((2, 10, 3, 8), (2, 12, 3, 8), causal=True, layout="bshd")
    assert a == b
    assert a.pairs == 2 * 3 * brute_pairs(True, None, 10, 12)
    c = cuflash.flops((10, 8), (12, 8), causal=True)
    assert c.pairs == brute_pairs(True, None, 10, 12)


# --------------------------------------------------------------------------- FLOP formulas


def test_flops_formulas_and_conventions():
    B, H, N, d = 2, 4, 100, 64
    fwd = cuflash.flops((B, H, N, d), (B, H, N, d))
    bwd = cuflash.flops((B, H, N, d), (B, H, N, d), pass_="bwd")
    both = cuflash.flops((B, H, N, d), (B, H, N, d), pass_="fwd+bwd")
    assert fwd.pairs == bwd.pairs == both.pairs == B * H * N * N
    assert fwd.flops == 4 * B * H * N * N * d
    assert bwd.flops == 10 * B * H * N * N * d
    assert both.flops == fwd.flops + bwd.flops
    assert fwd.dense_equivalent == fwd.flops  # non-causal, no window: the conventions coincide
    assert bwd.dense_equivalent == 5 * (4 * B * H * N * N * d) // 2
    assert "4*pairs*d" in fwd.convention and "10*pairs*d" in bwd.convention
    assert "peers" in fwd.dense_convention and "2.5" in bwd.dense_convention

    c = cuflash.flops((B, H, N, d), (B, H, N, d), causal=True)
    cb = cuflash.flops((B, H, N, d), (B, H, N, d), causal=True, pass_="bwd")
    assert c.pairs == B * H * N * (N + 1) // 2
    assert c.flops == 4 * d * B * H * N * (N + 1) // 2
    assert c.dense_equivalent == 4 * B * H * N * N * d // 2  # peers: halved, diagonal not counted
    assert cb.dense_equivalent == 5 * (4 * B * H * N * N * d // 2) // 2  # 2.5x the causal forward's
    assert c.flops > c.dense_equivalent
    assert "halved" in c.dense_convention

    # GQA: K/V heads do not change the work; decoding: one query over L keys.
    g = cuflash.flops((1, 32, 1, 128), (1, 8, 4096, 128))
    assert g.flops == 4 * 32 * 4096 * 128 == g.dense_equivalent
    assert math.isclose(g.tflops_per_s(1e-3), g.flops / 1e-3 / 1e12)


def test_flops_window_is_ignored_by_dense_equivalent_only():
    f = cuflash.flops((1, 2, 64, 32), (1, 2, 64, 32), window=(8, 8))
    assert f.pairs == 2 * brute_pairs(False, (8, 8), 64, 64) < 2 * 64 * 64
    assert f.dense_equivalent == 4 * 2 * 64 * 64 * 32
    assert "window ignored" in f.dense_convention


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("kernels", ["auto", "mma_sync"])
def test_memory_tiled_forward_hand_computed(monkeypatch, kernels):
    # The modelled GPU is the H200: its wgmma kernel by default, the mma.sync one when forced.
    monkeypatch.setenv("CUFLASH_KERNELS", kernels)
    r = cuflash.memory_report((2, 8, 1000, 64), (2, 2, 1000, 64), dtype="bfloat16")
    by = {e.name: e for e in r.entries}
    assert by["Q"].bytes == 2 * 8 * 1000 * 64 * 2 and by["Q"].category == accounting.INPUT
    assert by["K"].bytes == by["V"].bytes == 2 * 2 * 1000 * 64 * 2
    assert by["O"].bytes == 2 * 8 * 1000 * 64 * 2 and by["O"].category == accounting.OUTPUT
    assert by["LSE"].bytes == 2 * 8 * 1000 * 4 and by["LSE"].category == accounting.SAVED
    smem = by["shared memory / block (fwd)"]
    assert smem.category == accounting.ON_CHIP
    if kernels == "auto":
        # Full attention at d=64: the 3-warpgroup persistent TMA kernel: 192-row Q and O tiles + 3 K
        # and 3 V tiles of 128 keys + 14 mbarriers + 1 KiB alignment slack.
        assert smem.bytes == (2 * 192 + 6 * 128) * 128 + 112 + 1024
        assert "attn_fwd_wgmma_tma_persistent" in smem.note
        # Causal N = 8000 (4000 keys per row on average): the table's tile, 192-row Q tile + 2 K and
        # 2 V tiles + 9 mbarriers + 1 KiB.
        longer = cuflash.memory_report((2, 8, 8000, 64), (2, 2, 8000, 64), dtype="bfloat16", causal=True)
        smem4k = {e.name: e for e in longer.entries}["shared memory / block (fwd)"]
        t = schedule.HOPPER_FORWARD_TILES[64]
        assert smem4k.bytes == (64 * t.warpgroups + 2 * t.stages * t.block_n) * 64 * 2 + 8 * (1 + 4 * t.stages) + 1024
        assert smem4k.bytes == (192 + 512) * 128 + 72 + 1024
        assert "attn_fwd_wgmma_tma<" in smem4k.note
    else:
        _, cfg = schedule.forward_tile(64)
        assert smem.bytes == (cfg.block_m + 2 * cfg.stages * cfg.block_n) * 64 * 2
    io_bytes = 2 * (2 * 8 * 1000 * 64 * 2) + 2 * (2 * 2 * 1000 * 64 * 2)
    assert r.device_bytes == io_bytes + 2 * 8 * 1000 * 4  # on-chip storage is not device memory
    assert r.beyond_inputs_outputs == 2 * 8 * 1000 * 4
    assert not any(e.category in (accounting.WORKSPACE, accounting.INTERMEDIATE) for e in r.entries)
    text = str(r)
    assert "not device memory" in text and f"{r.device_bytes:,}" in text


def test_memory_tiled_backward_hand_computed():
    B, Hq, Hkv, N, d = 1, 4, 4, 300, 128
    r = cuflash.memory_report((B, Hq, N, d), (B, Hkv, N, d), dtype="float16", pass_="bwd")
    by = {e.name: e for e in r.entries}
    assert {n for n, e in by.items() if e.category == accounting.INPUT} == {"Q", "K", "V", "O", "dO"}
    assert {n for n, e in by.items() if e.category == accounting.OUTPUT} == {"dQ", "dK", "dV"}
    # The H200 runs the warp-specialized wgmma K/V kernel at d=128: its dQ accumulator holds 64 x 64
    # chunks, so each head's 300 rows are padded to 320.
    assert schedule.hopper_backward_tile(128, False).ws
    assert by["dQ accumulator"].bytes == 1 * 4 * 320 * 128 * 4
    # K, V, 2 Q and 2 dO tiles, dS^T, 2 x (lse, D) rows, two "landed" mbarriers, (WS) two "free"
    # mbarriers, alignment to 128 bytes and the two math warpgroups' 16 KiB dQ tiles, 1 KiB slack.
    bt = schedule.HOPPER_BACKWARD_TILES[128]
    assert (bt.block_m, bt.block_n, bt.tma) == (64, 128, True)
    tiles = (2 * 128 + 4 * 64) * 128 * 2 + 128 * 64 * 2 + 16 * 64 + 16
    assert by["shared memory / block (bwd)"].bytes == tiles + 16 + 96 + 2 * 64 * 64 * 4 + 1024
    assert by["shared memory / block (bwd)"].category == accounting.ON_CHIP
    assert by["D"].bytes == 1 * 4 * 300 * 4
    assert r.device_bytes == 8 * (1 * 4 * 300 * 128 * 2) + 1 * 4 * 300 * 4 + 1 * 4 * 320 * 128 * 4 + 1 * 4 * 300 * 4
    assert r.beyond_inputs_outputs == 1 * 4 * 300 * 4 + 1 * 4 * 320 * 128 * 4 + 1 * 4 * 300 * 4
    # Deterministic: the TMA kernel (the dQ kernel writes a row-major accumulator, no padded rows).
    det = {e.name: e for e in cuflash.memory_report((B, Hq, N, d), (B, Hkv, N, d), dtype="float16", pass_="bwd",
                                                    deterministic=True).entries}
    assert det["dQ accumulator"].bytes == 1 * 4 * 300 * 128 * 4
    assert det["shared memory / block (bwd)"].bytes == tiles + 1024


def test_memory_dq_accumulator_is_padded_to_the_head_dim_bucket():
    # d=80 runs in the 128 bucket; deterministic rows stay 100, the warp-specialized kernel's pad to 128
    shapes = (2, 3, 100, 80), (2, 3, 100, 80)
    for deterministic, rows in ((True, 100), (False, 128)):
        r = cuflash.memory_report(*shapes, pass_="bwd", dtype="bfloat16", deterministic=deterministic)
        by = {e.name: e for e in r.entries}
        assert by["dQ accumulator"].bytes == 2 * 3 * rows * 128 * 4
    # d=256 runs the split-head-dim wgmma kernel, which adds dQ in 64 x 64 fragment-order chunks
    # too (staged in its Q/dO tiles): rows padded to 128; d=160 and 192 run that same kernel, so
    # their rows are 256 floats too (deterministic: the mma.sync dQ kernel's, 100 rows of the
    # bucket's 192)
    assert schedule.hopper_backward_head_dim(192) == 256 and not schedule.HOPPER_BACKWARD_TILES[192].ws
    for d, det, rows, width in ((256, False, 128, 256), (192, False, 128, 256), (160, False, 128, 256),
                                (192, True, 100, 192), (160, True, 100, 192)):
        by = {e.name: e for e in cuflash.memory_report((2, 3, 100, d), (2, 3, 100, d), pass_="bwd",
                                                       deterministic=det).entries}
        assert by["dQ accumulator"].bytes == 2 * 3 * rows * width * 4, (d, det)


def test_memory_reference_forward_and_in_place_variant():
    B, H, N, d = 2, 3, 257, 32
    r = cuflash.memory_report((B, H, N, d), (B, H, N, d), method="reference", dtype="float16")
    by = {e.name: e for e in r.entries}
    assert by["S"].bytes == by["P"].bytes == 2 * 3 * 257 * 257 * 4
    assert by["S"].category == by["P"].category == accounting.INTERMEDIATE
    inputs_outputs = 4 * (2 * 3 * 257 * 32 * 2)
    lse = 2 * 3 * 257 * 4
    assert r.device_bytes == inputs_outputs + lse + 2 * (2 * 3 * 257 * 257 * 4)
    assert r.device_bytes_in_place == inputs_outputs + lse + 1 * (2 * 3 * 257 * 257 * 4)
    assert "in-place variant" in r.table()


def test_memory_reference_fwd_bwd_peak_is_the_larger_phase():
    B, H, N, d = 1, 2, 50, 16
    r = cuflash.memory_report((B, H, N, d), (B, H, N, d), method="reference", dtype="float32", pass_="fwd+bwd")
    nn = 1 * 2 * 50 * 50 * 4
    persistent = 8 * (1 * 2 * 50 * 16 * 4) + 1 * 2 * 50 * 4  # Q K V dO O dQ dK dV, LSE
    d_vec = 1 * 2 * 50 * 4
    # backward phase: S, P, dP, dS and D (larger than the forward's S and P)
    assert r.device_bytes == persistent + 4 * nn + d_vec
    # in place: P over S, dS over dP
    assert r.device_bytes_in_place == persistent + 2 * nn + d_vec


def test_decode_shape_reports_the_decode_kernel_and_its_splits():
    # Without splits=, a decode shape gets the splits the decode kernel picks on the H200, and
    # the decode kernel's shared memory; a prefill shape gets neither. B=4, Hkv=8: 9 splits, more
    # than a cluster holds, so a combine kernel merges them through float32 partials.

    r = cuflash.memory_report((4, 32, 1, 128), (4, 8, 16384, 128), pass_="fwd")
    by = {e.name: e for e in r.entries}
    p = types.SimpleNamespace(dtype=np.dtype(BFLOAT16), d=128, nq=1, nk=16384, hq=32, hkv=8, group=4, batch=4, causal=None)
    rt, _, splits, _, cluster = plan_decode.launch_plan(p, accounting.H200_SM_COUNT)
    assert splits > 1 and not cluster and by["O partials"].bytes == 4 * 32 * 1 * splits * 128 * 4
    main = plan_decode.decode_specs(BFLOAT16, 128, rt, False, True)[0]
    smem = by["shared memory / block (fwd)"]
    assert smem.bytes == main.smem_bytes and main.short_name in smem.note
    prefill = {e.name for e in cuflash.memory_report((8, 32, 512, 128), (8, 8, 16384, 128), pass_="fwd").entries}
    assert "O partials" not in prefill


def test_decode_cluster_shape_reports_no_partials():
    # B=8, Hkv=8: 2-8 splits, merged inside a thread-block cluster: no workspace; the shared
    # memory entry names the cluster kernel (the same shared memory as the combine path's kernel).

    r = cuflash.memory_report((8, 32, 1, 128), (8, 8, 12288, 128), pass_="fwd")
    by = {e.name: e for e in r.entries}
    p = types.SimpleNamespace(dtype=np.dtype(BFLOAT16), d=128, nq=1, nk=12288, hq=32, hkv=8, group=4, batch=8, causal=None)
    lp = plan_decode.launch_plan(p, accounting.H200_SM_COUNT)
    assert lp.cluster and lp.splits in plan_decode.CLUSTER_SIZES
    assert not any(e.category == "workspace" for e in r.entries)
    spec = plan_decode.launch_spec(BFLOAT16, 128, False, lp)  # the plan's tile (at 12k: ring 1, the same bytes)
    assert spec.expression.startswith("attn_decode_cluster<")
    smem = by["shared memory / block (fwd)"]
    assert smem.bytes == spec.smem_bytes == plan_decode.decode_specs(BFLOAT16, 128, lp.row_tiles, False, True)[0].smem_bytes
    assert spec.short_name in smem.note
    # an explicit splits= still models the combine kernel's partials
    forced = {e.name: e for e in cuflash.memory_report((8, 32, 1, 128), (8, 8, 12288, 128), pass_="fwd", splits=3).entries}
    assert forced["O partials"].bytes == 8 * 32 * 1 * 3 * 128 * 4


def test_memory_arrays_give_dtype_and_splits_add_workspace():
    q = np.random.default_rng().standard_normal((3, 4, 1, 64)).astype(np.float16)
    k = np.random.default_rng().standard_normal((3, 1, 4096, 64)).astype(np.float16)
    r = cuflash.memory_report(q, k, k, splits=8, registers=100)
    assert r.dtype == "float16"
    by = {e.name: e for e in r.entries}
    assert by["O partials"].bytes == 3 * 4 * 1 * 8 * 64 * 4
    assert by["LSE partials"].bytes == 3 * 4 * 1 * 8 * 4
    # One query token over 4096 keys: the split-KV decode kernel runs (its threads, its smem).
    assert "attn_decode<" in by["shared memory / block (fwd)"].note
    assert by["registers / block (fwd)"].bytes == 100 * 4 * schedule.DECODE_TILES[64].threads == 100 * 4 * 128
    assert by["registers / block (fwd)"].category == accounting.ON_CHIP
    assert r.device_bytes == q.nbytes + 2 * k.nbytes + q.nbytes + 3 * 4 * 4 + 3 * 4 * 8 * 64 * 4 + 3 * 4 * 8 * 4
    # A bfloat16 array: dtype read from it.
    qb = q.astype(BFLOAT16)
    assert cuflash.memory_report(qb, k.astype(BFLOAT16)).dtype == "bfloat16"


# --------------------------------------------------------------------------- IO model


def brute_tile_traffic(causal, nq, nk, bm, bn):
    """Enumerate every (query tile, K/V tile) pair with masks.tile_is_visible."""
    causal = masks.normalize_causal(causal)
    kv_keys = q_rows = pairs = 0
    for row0 in range(0, nq, bm):
        row1 = min(nq, row0 + bm)
        for col0 in range(0, nk, bn):
            col1 = min(nk, col0 + bn)
            if masks.tile_is_visible(causal, nq, nk, row0, row1, col0):
                kv_keys += col1 - col0
                q_rows += row1 - row0
                pairs += (row1 - row0) * (col1 - col0)
    return kv_keys, q_rows, pairs


def test_io_non_causal_kv_reads():
    B, H, N, d = 2, 4, 1000, 64
    m = cuflash.io_model((B, H, N, d))
    by = {e.name: e for e in m.entries}
    assert by["K"].reads == by["V"].reads == math.ceil(N / m.block_m) * N * d * H * B
    assert by["Q"].reads == B * H * N * d and by["O"].writes == B * H * N * d
    assert by["LSE"].writes == B * H * N and by["LSE"].itemsize == 4
    assert m.bytes == 2 * (B * H * N * d * 2) + 2 * (math.ceil(N / m.block_m) * N * d * H * B * 2) + B * H * N * 4
    assert m.paper_elements == B * H * N * N * d * d / ((228 * 1024) // 2)
    assert m.standard_elements == B * H * (2 * N * d + N * N)
    # reference: write S, read S, write P, read P; read Q, K, V, write O; write LSE
    assert m.reference_elements == B * H * (4 * N * N + 4 * N * d + N)
    assert "K" in m.table() and "Theta" in m.table()


def test_io_decode_keeps_the_comparison_counts():
    """A decode shape runs the split-KV kernel, but the paper's bound, standard attention's count and
    the materializing reference still describe the same pass (they were once left at zero there)."""
    B, H, HKV, L, d = 4, 8, 2, 4096, 128
    m = cuflash.io_model((B, H, 1, d), nk=L, hkv=HKV)
    assert any(e.name == "O partials" for e in m.entries)  # the decode kernel's model
    assert m.paper_elements == B * H * 1 * L * d * d / ((228 * 1024) // 2)
    assert m.standard_elements == B * H * ((1 + L) * d + L)
    assert m.reference_elements == B * H * (4 * L + 2 * (1 + L) * d + 1)
    # reading the inputs once dominates the paper's count at one query row
    assert any("leaves out reading the inputs once" in a for a in m.assumptions)


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (300, 1000), (1000, 300), (20, 4096), (129, 65)])
def test_io_causal_matches_tile_enumeration(causal, nq, nk):
    B, H, Hkv, d = 2, 4, 2, 64
    full = cuflash.io_model((B, H, nq, d), nk=nk, hkv=Hkv)
    m = cuflash.io_model((B, H, nq, d), nk=nk, hkv=Hkv, causal=causal, pass_="fwd+bwd")
    fwd_tile = accounting.forward_launch("bfloat16", d, causal, nq=nq, nk=nk)  # what the H200 launches
    assert (m.block_m, m.block_n) == (fwd_tile.block_m, fwd_tile.block_n)
    kv_keys, _, pairs = brute_tile_traffic(causal, nq, nk, m.block_m, m.block_n)
    _, q_rows, bwd_pairs = brute_tile_traffic(causal, nq, nk, m.bwd_block_m, m.bwd_block_n)
    assert m.bwd_computed_pairs == B * H * bwd_pairs
    by = {e.name: e for e in m.entries}
    assert by["fwd: K"].reads == by["fwd: V"].reads == B * H * kv_keys * d
    assert by["bwd: Q"].reads == by["bwd: dO"].reads == B * H * q_rows * d
    assert by["bwd: K"].reads == B * Hkv * nk * d  # once per K/V tile per K/V head
    assert m.computed_pairs == B * H * pairs
    assert m.computed_pairs >= cuflash.flops((B, H, nq, d), (B, Hkv, nk, d), causal=causal).pairs
    # (the same tile without a mask; full attention itself may launch another tile)
    full_k = B * H * math.ceil(nq / m.block_m) * nk * d
    assert {e.name: e for e in full.entries}["K"].reads == B * H * math.ceil(nq / full.block_m) * nk * d
    assert by["fwd: K"].reads <= full_k
    if min(nq, nk) >= 300:
        assert by["fwd: K"].reads < full_k  # causal skips the tiles above the diagonal


def test_io_tiles_follow_the_backward_table():
    bt = schedule.HOPPER_BACKWARD_TILES[128]  # the K/V kernel the H200 runs
    m = cuflash.io_model((1, 2, 512, 128), pass_="bwd")
    assert (m.bwd_block_m, m.bwd_block_n) == (bt.block_m, bt.block_n)


def test_io_backward_counts():
    B, H, N, d = 1, 2, 256, 80  # d=80 runs in the 128-wide bucket: the accumulator is zeroed 128 wide
    m = cuflash.io_model((B, H, N, d), pass_="bwd")
    by = {e.name: e for e in m.entries}
    n_kv_tiles = math.ceil(N / m.bwd_block_n)
    assert by["Q"].reads == by["dO"].reads == n_kv_tiles * B * H * N * d
    assert by["LSE"].reads == by["D"].reads == n_kv_tiles * B * H * N
    # warp-specialized kernel (d=128 bucket): whole 64 x 64 chunks, all 128 columns, per visible tile
    assert by["dQ accumulator"].reads == n_kv_tiles * B * H * N * 128 + B * H * N * d
    assert by["dQ accumulator"].writes == B * H * N * 128 + n_kv_tiles * B * H * N * 128
    assert by["dK"].writes == by["dV"].writes == B * H * N * d
    assert by["D"].writes == B * H * N
    # reference backward: S w/r, P w + 2 r, dP w/r, dS w + 2 r; Q 2, dO 3, O 1, dQ 1; K 2, V 1, dK 1, dV 1
    assert m.reference_elements == B * H * (10 * N * N + 7 * N * d + 5 * N * d + 3 * N)
    # Nq = 200: each visited K/V tile adds rows up to 256 (the chunks' multiple of 64)
    m = cuflash.io_model((B, H, 200, d), pass_="bwd")
    by = {e.name: e for e in m.entries}
    tiles = math.ceil(200 / m.bwd_block_n)
    assert by["dQ accumulator"].reads == tiles * B * H * 256 * 128 + B * H * 200 * d
    assert by["dQ accumulator"].writes == B * H * 256 * 128 + tiles * B * H * 256 * 128
    # d=256: the split-head-dim wgmma kernel's atomics, 256 columns per row; d=160 runs the same
    # kernel (its columns past d are zeros, added all the same), d=32 the mma.sync kernel (d columns)
    for N, d, width, cols in ((256, 256, 256, 256), (256, 160, 256, 256), (256, 32, 32, 32)):
        m = cuflash.io_model((B, H, N, d), pass_="bwd")
        by = {e.name: e for e in m.entries}
        n_kv_tiles = math.ceil(N / m.bwd_block_n)
        assert by["dQ accumulator"].reads == n_kv_tiles * B * H * N * cols + B * H * N * d, d
        assert by["dQ accumulator"].writes == B * H * N * width + n_kv_tiles * B * H * N * cols, d


def test_io_deterministic_backward_moves_dq_to_its_own_kernel():
    B, H, N, d = 1, 2, 1000, 64
    det = cuflash.io_model((B, H, N, d), pass_="bwd", causal=True, deterministic=True)
    by = {e.name: e for e in det.entries}
    _, bt = schedule.backward_tile(d)
    keys, _, _ = brute_tile_traffic(True, N, N, bt.dq_block_m, bt.dq_block_n)
    assert by["K (dQ kernel)"].reads == B * H * keys * d
    assert by["dQ accumulator"].reads == by["dQ accumulator"].writes == B * H * N * d
    atomic = cuflash.io_model((B, H, N, d), pass_="bwd", causal=True)
    assert "K (dQ kernel)" not in {e.name for e in atomic.entries}
    with pytest.raises(TypeError, match="deterministic"):
        cuflash.io_model((B, H, N, d), deterministic="yes")


def test_io_sram_and_dtype():
    m = cuflash.io_model((1, 1, 4096, 128), dtype="float32", sram_bytes=100 * 1024)
    assert m.sram_elements == 100 * 1024 // 4
    assert m.paper_elements == 4096 * 4096 * 128 * 128 / (100 * 1024 // 4)
    small = cuflash.io_model((1, 1, 64, 128))
    assert any("d <= M <= N d" in a for a in small.assumptions)


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("call,exc,word", [
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 4), pass_="backward"), ValueError, "pass_"),
    (lambda: cuflash.flops("1,2,8,4", (1, 2, 8, 4)), TypeError, "q_shape"),
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 5)), ValueError, "head dim"),
    (lambda: cuflash.flops((1, 3, 8, 4), (1, 2, 8, 4)), ValueError, "k_shape"),
    (lambda: cuflash.flops((1, 2, 8, -4), (1, 2, 8, 4)), ValueError, "q_shape[3]"),
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 4), causal="yes"), ValueError, "causal"),
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 4), window=(-2, 0)), ValueError, "window[0]"),
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 4), window=3), TypeError, "window"),
    (lambda: cuflash.flops((1, 2, 8, 4), (1, 2, 8, 4), layout="bsdh"), ValueError, "layout"),
    (lambda: cuflash.flops((2, 2, 8, 4), (2, 2, 8, 4), kv_lens=[3]), ValueError, "kv_lens"),
    (lambda: cuflash.flops((2, 2, 8, 4), (2, 2, 8, 4), kv_lens=[3, 9]), ValueError, "kv_lens[1]"),
    (lambda: cuflash.flops((2, 2, 8, 4), (2, 2, 8, 4), kv_lens=[3.0, 2]), TypeError, "kv_lens[0]"),
    (lambda: cuflash.flops((5, 2, 4), (5, 2, 4), cu_seqlens_q=[0, 5]), ValueError, "cu_seqlens_k"),
    (lambda: cuflash.flops((5, 2, 4), (5, 2, 4), cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 5]), ValueError, "cu_seqlens_q"),
    (lambda: cuflash.flops((5, 2, 4), (5, 2, 4), cu_seqlens_q=[0, 3, 2, 5], cu_seqlens_k=[0, 1, 2, 5]), ValueError, "non-decreasing"),
    (lambda: cuflash.flops((1, 5, 2, 4), (5, 2, 4), cu_seqlens_q=[0, 5], cu_seqlens_k=[0, 5]), ValueError, "q_shape"),
    (lambda: cuflash.memory_report((1, 2, 8, 4), (1, 2, 8, 4), method="naive"), ValueError, "method"),
    (lambda: cuflash.memory_report((1, 2, 8, 4), (1, 2, 8, 4), dtype="int64"), TypeError, "dtype"),
    (lambda: cuflash.memory_report((1, 2, 8, 4), (1, 2, 9, 4), (1, 2, 8, 4)), ValueError, "v"),
    (lambda: cuflash.memory_report((1, 2, 8, 4), (1, 2, 8, 4), splits=0), ValueError, "splits"),
    (lambda: cuflash.memory_report((1, 2, 8, 4), (1, 2, 8, 4), config="big"), TypeError, "config"),
    (lambda: cuflash.memory_report(np.zeros((1, 2, 8, 4), np.float16), (1, 2, 8, 4), dtype="float32"), TypeError, "q"),
    (lambda: cuflash.io_model((2, 8, 4)), ValueError, "shape"),
    (lambda: cuflash.io_model((1, 1, 8, 512)), ValueError, "shape: head dim"),
    (lambda: cuflash.memory_report((1, 1, 8, 512), (1, 1, 8, 512)), ValueError, "q: head dim"),
    (lambda: cuflash.io_model((1, 4, 8, 4), hkv=3), ValueError, "hkv"),
    (lambda: cuflash.io_model((1, 4, 8, 4), sram_bytes=0), ValueError, "sram_bytes"),
    (lambda: cuflash.io_model((1, 4, 8, 4), pass_="both"), ValueError, "pass_"),
])
def test_bad_arguments_name_the_argument(call, exc, word):
    with pytest.raises(exc) as info:
        call()
    assert word in str(info.value)


# --------------------------------------------------------------------------- report command


def test_report_prints_all_tables(capsys):
    assert report.main(["--shape", "2,8,1000,64", "--hkv", "2", "--causal"]) == 0
    out = capsys.readouterr().out
    for section in ("== FLOPs ==", "== Memory: tiled, fwd ==", "== Memory: reference, bwd ==",
                    "== Memory summary", "== HBM traffic model: tiled, fwd =="):
        assert section in out
    assert f"{2 * 8 * 1000 * 1001 // 2:,}" in out  # exact causal pairs
    assert f"{2 * 8 * 1000 * 1000 * 4:,}" in out  # reference's S buffer
    assert "not device memory" in out


def test_report_decode(capsys):
    assert report.main(["--shape", "4,32,1,128", "--hkv", "8", "--decode", "4096", "--splits", "4"]) == 0
    out = capsys.readouterr().out
    assert "Nq=1 Nk=4096" in out
    assert f"{4 * 32 * 4096:,}" in out  # pairs
    assert "O partials" in out


@pytest.mark.parametrize("argv", [["--shape", "1,2,3"], ["--shape", "1,8,16,64", "--hkv", "3"],
                                  ["--shape", "1,0,16,64"], ["--dtype", "int8", "--shape", "1,1,1,1"],
                                  ["--shape", "1,1,16,512"]])
def test_report_bad_arguments_exit_2(argv, capsys):
    assert report.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_report_measure_without_gpu_or_ncu(capsys):
    ncu, why = report.find_gpu_and_ncu()
    if ncu is not None:
        pytest.skip("a GPU and ncu are present: --measure would run for real")
    assert report.main(["--shape", "1,2,128,64", "--measure"]) == 2
    err = capsys.readouterr().err
    assert "--measure needs" in err and why in err


def test_report_plot(tmp_path, capsys):
    rc = report.main(["--shape", "1,4,256,64", "--plot", str(tmp_path / "plots")])
    if report._have_matplotlib():
        assert rc == 0
        assert (tmp_path / "plots" / "memory_vs_n.png").stat().st_size > 0
        assert (tmp_path / "plots" / "io_vs_n.png").stat().st_size > 0
    else:
        assert rc == 2
        assert "matplotlib" in capsys.readouterr().err


def test_plot_series_shapes_the_claims():
    s = report.plot_series(dict(batch=1, hq=4, hkv=4, nq=256, nk=256, d=64, dtype="bfloat16", causal=False),
                           lengths=[256, 1024, 4096])
    assert s["n"] == [256, 1024, 4096]
    # tiled memory is linear in N up to a workspace bounded independently of N (the forward's key
    # split of a grid under one wave: fewer than SMs x (SPLIT_MAX - 1) partial tiles); the
    # reference's grows with N^2
    work = [accounting.memory_report((1, 4, n, 64), (1, 4, n, 64), dtype="bfloat16").total(accounting.WORKSPACE)
            for n in (256, 1024, 4096)]
    assert s["tiled"][2] - work[2] == 16 * (s["tiled"][0] - work[0])
    bound = accounting.H200_SM_COUNT * (schedule.SPLIT_MAX - 1) * 192 * 64 * (4 + 4 / 64)
    assert 0 < work[2] <= bound  # N = 4096 splits: 88 tiles of 192 rows on 132 SMs, in thirds
    assert s["reference"][2] - s["inputs_outputs"][2] > 200 * (s["reference"][0] - s["inputs_outputs"][0])


def test_ncu_csv_parsing_and_command():
    text = "\n".join([
        "==PROF== Connected to process 123",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"',
        '"","","","","","","","Kbyte","byte","usecond"',
        '"0","123","python3","h","attn_fwd<Bf16, 64>","1","7","1,024.5","2048","12.5"',
        '"1","123","python3","h","attn_fwd<Bf16, 64>","1","7","1","0","0.5"',
        "==PROF== Disconnected from process 123",
    ])
    rows = report.parse_ncu_csv(text)
    assert len(rows) == 2
    assert rows[0]["dram__bytes_read.sum"] == pytest.approx(1024.5e3)
    assert rows[0]["dram__bytes_write.sum"] == 2048
    assert rows[0]["gpu__time_duration.sum"] == pytest.approx(12.5e-6)
    assert rows[1]["gpu__time_duration.sum"] == pytest.approx(0.5e-6)
    assert report.parse_ncu_csv("no csv here") == []
    with pytest.raises(ValueError, match="unknown unit"):
        report.parse_ncu_csv(text.replace('"Kbyte"', '"parsecs"'))
    dims = dict(batch=1, hq=2, hkv=1, nq=1, nk=512, d=64, dtype="bfloat16", causal=True)
    cmd = report.ncu_command("/usr/bin/ncu", dims)
    assert cmd[:3] == ["/usr/bin/ncu", "--clock-control", "none"]
    assert ",".join(report.NCU_METRICS) in cmd and report.KERNEL_REGEX in cmd
    pattern = report.KERNEL_REGEX.removeprefix("regex:")
    assert all(re.search(pattern, k) for k in ("attn_fwd", "attn_decode", "attn_decode_combine"))
    assert not re.search(pattern, "attn_bwd_kv")
    assert "--launch-only" in cmd and "--causal" in cmd and cmd[cmd.index("--decode") + 1] == "512"


@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
def test_io_decode_reads_the_cache_once_per_kv_head(causal):
    """Few query tokens over a long cache: the split-KV kernel's traffic, not the prefill tiles'."""
    from types import SimpleNamespace

    from cuflash.core import masks

    B, H, Hkv, nq, nk, d = 8, 32, 8, 1, 12288, 128
    m = cuflash.io_model((B, H, nq, d), nk=nk, hkv=Hkv, causal=causal)
    by = {e.name: e for e in m.entries}
    off = masks.causal_offset(masks.normalize_causal(causal), nq, nk)
    keys = nk if off is None else min(nk, nq + off)
    assert by["K"].reads == by["V"].reads == B * Hkv * keys * d  # not B * H: GQA rows share the pass
    p = SimpleNamespace(dtype=np.dtype(BFLOAT16), d=d, nq=nq, nk=nk, hq=H, hkv=Hkv, group=H // Hkv, batch=B,
                        causal=masks.normalize_causal(causal))
    _, _, splits, _, cluster = plan_decode.launch_plan(p, 132)
    assert cluster and splits > 1  # B=8, Hkv=8: the splits merge in a cluster, not through memory
    assert by["O partials"].reads == by["O partials"].writes == by["LSE partials"].reads == 0
    # B=2: more splits than a cluster holds, so the combine kernel reads the float32 partials back
    m2 = cuflash.io_model((2, H, nq, d), nk=nk, hkv=Hkv, causal=causal)
    by2 = {e.name: e for e in m2.entries}
    p2 = SimpleNamespace(**{**vars(p), "batch": 2})
    _, _, splits2, _, cluster2 = plan_decode.launch_plan(p2, 132)
    rows = 2 * Hkv * splits2 * (H // Hkv) * nq
    assert not cluster2 and splits2 > 8 and by2["O partials"].reads == by2["O partials"].writes == rows * d
    assert m.computed_pairs == B * H * masks.pair_count(masks.normalize_causal(causal), nq, nk)


@pytest.mark.parametrize("B, H, nk, blocks", [(2, 64, 32768, 2), (1, 32, 32768, 2), (1, 64, 32768, 4), (8, 32, 32768, 1)])
def test_io_decode_row_blocks_reread_the_cache(monkeypatch, B, H, nk, blocks):
    """One K/V head with many query heads (MQA, d=128): each of the planner's row blocks reads the
    K/V head (two-row-tile blocks, or one-row-tile blocks where its splits would be short); the
    partials are the same rows either way, and the split counters one per (sequence, row block).
    The table's tiles (the wide-rows rule off); with the rule, B=2 Hq=64 reads the head once."""
    from types import SimpleNamespace


    if (B, H) == (2, 64):
        wide = {e.name: e for e in cuflash.io_model((B, H, 1, 128), nk=nk, hkv=1).entries}
        assert wide["K"].reads == B * nk * 128
    monkeypatch.setattr(plan_decode, "WIDE_ROWS_AUTO", False)

    nq, d = 1, 128
    p = SimpleNamespace(dtype=np.dtype(BFLOAT16), d=d, nq=nq, nk=nk, hq=H, hkv=1, group=H, batch=B, causal=None)
    assert plan_decode.row_blocks(p, 132) == blocks
    m = cuflash.io_model((B, H, nq, d), nk=nk, hkv=1)
    by = {e.name: e for e in m.entries}
    assert by["K"].reads == by["V"].reads == blocks * B * nk * d
    lp = plan_decode.launch_plan(p, 132)
    assert lp.row_tiles == -(-(H // blocks) // 16)
    rows = B * lp.splits * H * nq if lp.splits > 1 and not lp.cluster else 0  # (row blocks split the rows, not add)
    assert by["O partials"].writes == rows * d and by["LSE partials"].writes == rows
    assert by["Q"].reads == by["O"].writes == B * H * nq * d
    assert ("row block" in by["K"].note) == (blocks > 1)
