"""Split-KV decode kernel vs the float64 reference, one sequence at a time (naive-error rule)."""

import types

import numpy as np
import pytest

import cuflash
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.core.layout import to_bhsd
from cuflash.core.problem import validate_forward
from cuflash.testing import poison, poisoned_allocations, random_inputs
from cuflash.backends import cuda
from cuflash.kernels import decode as decode_kernels
from cuflash.kernels import device
from cuflash.plan import decode as plan_decode

from _kvlens_check import check_per_sequence
from test_decode_cluster import _launch  # records the expressions gpu_decode launches

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("nq", [1, 2, 7, 16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 1, 64), (4, 4, 256), (8, 2, 40)])
def test_decode_kv_lens(dtype, causal, nq, hq, hkv, d):
    rng = np.random.default_rng([nq, hq, hkv, d, len(str(causal)), dtype.itemsize])
    b, nk = 4, 1500
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    p = validate_forward(qg, kg, vg, causal=causal)
    used_decode = cuda.decode_applies(p, to_bhsd(kg, p, hkv, nk), to_bhsd(vg, p, hkv, nk))
    o = poison(cupy.empty(qg.shape, dtype=qg.dtype))
    # lse and the split partials are allocated inside: from a poisoning allocator.
    o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal=causal, kv_lens=lg, return_lse=True, out=o))
    check_per_sequence(o, lse, q, k, v, lens, causal, dtype)
    if (hq // hkv) * nq <= 32 and d <= 128:
        assert used_decode  # these shapes must take the split-KV kernel


@pytest.mark.parametrize("splits", [1, 2, 7, 40])
def test_decode_split_counts(splits):
    rng = np.random.default_rng(splits)
    b, hq, hkv, nq, nk, d = 2, 8, 2, 1, 4000, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg, causal=True)
    o4 = poison(cupy.empty(qg.shape, dtype=qg.dtype))
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    poisoned_allocations(lambda: decode_kernels.forward(p, qg, kg, vg, o4, lse3, splits=splits))
    check_per_sequence(o4, lse3, q, k, v, [nk] * b, True, BFLOAT16)


@pytest.mark.parametrize("use_pdl", [pytest.param(True, id="pdl"), pytest.param(False, id="plain-launch")])
@pytest.mark.parametrize("splits", [3, 40])
def test_decode_combine_as_dependent(monkeypatch, use_pdl, splits):
    # The combine kernel as the split kernel's programmatic dependent (the size gate lowered to
    # every cache): it must wait for every split's partials. Output and LSE start poisoned.
    from cuflash.kernels import pdl

    monkeypatch.setattr(decode_kernels, "PDL_COMBINE_MIN_BYTES", 0)
    monkeypatch.setattr(pdl, "_ENABLED", use_pdl)
    rng = np.random.default_rng(splits + 90)
    b, hq, hkv, nq, nk, d = 3, 16, 4, 2, 5000, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg, causal="bottom_right")
    o4 = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    decode_kernels.forward(p, qg, kg, vg, o4, lse3, splits=splits, cluster=False, merge="kernel")
    check_per_sequence(o4, lse3, q, k, v, [nk] * b, "bottom_right", BFLOAT16)


def test_decode_no_lens_matches_prefill_path_rule():
    rng = np.random.default_rng(7)
    q, k, v = random_inputs(rng, (8, 32, 1, 128), (8, 8, 4096, 128), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal=True, return_lse=True))
    check_per_sequence(o, lse, q, k, v, [4096] * 8, True, BFLOAT16)


# Windows that cut key tiles and 16-key groups mid-way, one side open, one key wide, wider than
# the cache; with and without kv_lens, every causal mode, GQA packing.
DECODE_WINDOWS = [(100, 0), (37, -1), (-1, 3), (0, 0), (5000, 5000), (1, 1)]


@pytest.mark.parametrize("window", DECODE_WINDOWS, ids=[f"w{l}_{r}" for l, r in DECODE_WINDOWS])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("nq", [1, 7, 16])
@pytest.mark.parametrize("with_lens", [False, True], ids=["nk", "kv_lens"])
def test_decode_window(monkeypatch, window, causal, nq, with_lens):
    """The split-KV kernel's band mask (attn_decode<..., WINDOW>): each token against the
    brute-force mask of its own sequence's keys; the decode kernel (not the band kernel) ran."""
    launched = []
    real = decode_kernels.launch_spec  # (the name the decode launch calls)
    monkeypatch.setattr(decode_kernels, "launch_spec",
                        lambda *a, **kw: launched.append(real(*a, **kw).expression) or real(*a, **kw))
    rng = np.random.default_rng([nq, len(str(causal)), window[0] + 9, window[1] + 5, int(with_lens)])
    b, hq, hkv, nk, d = 4, 8, 2, 1500, 64 if nq == 16 else 128  # (64 packed rows: d=64's tile)
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), FLOAT16)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32) if with_lens else np.full(b, nk, np.int32)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    o = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)  # poisoned
    o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal=causal, window=window,
                                                            kv_lens=lg if with_lens else None, return_lse=True, out=o))
    check_per_sequence(o, lse, q, k, v, lens, causal, FLOAT16, window=window)
    assert launched and all(_window_flag(e) == "true" for e in launched), launched


def _window_flag(expr):
    """The WINDOW template argument of an attn_decode / attn_decode_cluster expression (after the
    vec flag and a cluster's size; a ring's follows it)."""
    assert expr.startswith("attn_decode"), expr
    args = expr[expr.index("<") + 1:-1].split(", ")
    i = 9 if expr.startswith("attn_decode_cluster<") else 8
    return args[i] if len(args) > i else "false"


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_window_split_counts(splits):
    # More splits than the window's keys need: the splits past its end read nothing and merge as -inf.
    rng = np.random.default_rng(splits + 50)
    b, hq, hkv, nq, nk, d = 2, 8, 2, 3, 4000, 64
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg, causal=True, window=(300, 0))
    o4 = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    decode_kernels.forward(p, qg, kg, vg, o4, lse3, splits=splits, cluster=False)
    check_per_sequence(o4, lse3, q, k, v, [nk] * b, True, FLOAT16, window=(300, 0))


@pytest.mark.parametrize("which", ["no_split", "long_splits"])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
@pytest.mark.parametrize("nq", [1, 7])  # GQA group 4: one and two packed row tiles
def test_decode_many_block_tiles(monkeypatch, which, causal, nq):
    # The tiles the planner takes with a (sequence, head) block per SM and for long splits
    # (schedule.DECODE_TILES_NO_SPLIT / _LONG_SPLITS), forced on a small batch (one split): kv_lens 0,
    # 1, mid-tile and full, output and LSE poisoned.
    tile = {"no_split": schedule.DECODE_TILES_NO_SPLIT, "long_splits": schedule.DECODE_TILES_LONG_SPLITS}[which][128]
    launched = _launch(monkeypatch)
    rng = np.random.default_rng([nq, len(which), len(str(causal))])
    b, hq, hkv, nk, d = 4, 32, 8, 1700, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    p = validate_forward(qg, kg, vg, causal=causal)
    o4 = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=lg, tile=tile, splits=1)
    check_per_sequence(o4, lse3, q, k, v, lens, causal, BFLOAT16)
    assert any(f", {tile.block_n}, {tile.warps}, {tile.stages}," in e for e in launched), launched


@pytest.mark.parametrize("per_sm", [1, 2, 4])
def test_decode_api_takes_the_no_split_tile(monkeypatch, per_sm):
    # Through the API with a paged cache, on a stand-in device of 8 SMs (device.sm_count): one,
    # two and four (sequence, K/V head) blocks per SM launch the no-split tile (ring 2), no split, no
    # combine; shuffled pages, NaN spare pages, kv_lens 0 and 1 among the sequences.
    from test_paged import run_paged

    sms, hkv, n = 8, 8, 3000
    monkeypatch.setattr(device, "sm_count", lambda device_id: sms)
    b = per_sm * sms // hkv
    launched = _launch(monkeypatch)
    rng = np.random.default_rng([b, n])
    lens = rng.integers(2, n, size=b).astype(np.int32)
    lens[:2] = [0, 1] if b > 1 else [n]
    run_paged(cupy, rng, BFLOAT16, b, 32, hkv, 1, n, 128, 64, lens, "bottom_right")
    t = schedule.DECODE_TILES_NO_SPLIT[128]
    want = f"attn_decode<Bf16, 128, 1, {t.block_n}, {t.warps}, {t.stages}, true, true, false, {t.ring}>"
    assert launched == [want], launched


@pytest.mark.parametrize("causal", [False, "top_left"], ids=["full", "tl"])
def test_decode_api_takes_the_cluster_ring(monkeypatch, causal):
    # Through the API on a stand-in device of 8 SMs: 4 splits of more than CLUSTER_RING_MIN_CHUNK
    # keys merge in a cluster and run ring 1 (DECODE_TILES_LONG_CLUSTER_SPLITS); kv_lens 0, 1,
    # mid-split and full; output and LSE poisoned.
    monkeypatch.setattr(device, "sm_count", lambda device_id: 8)
    launched = _launch(monkeypatch)
    rng = np.random.default_rng([len(str(causal)), 41])
    b, hq, hkv, nk, d = 4, 16, 1, 9000, 128
    q, k, v = random_inputs(rng, (b, hq, 1, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
    out = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
    o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal=causal, kv_lens=lg, return_lse=True, out=out))
    check_per_sequence(o, lse, q, k, v, lens, causal, BFLOAT16)
    t = schedule.DECODE_TILES_LONG_CLUSTER_SPLITS[128]
    want = f"attn_decode_cluster<Bf16, 128, 1, {t.block_n}, {t.warps}, {t.stages}, {'true' if causal else 'false'}, true, 4, false, 1>"
    assert launched == [want], launched


@pytest.mark.parametrize("ring", [1, 2])
@pytest.mark.parametrize("shape", [(16, 4, 2), (16, 4, 3), (16, 8, 2), (32, 4, 2)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", ["lens-br", "paged-tl", "window", "split-cluster", "split-combine"])
def test_decode_block_rings(monkeypatch, ring, shape, case):
    # The block rings (DecodeTile.ring 1 / 2) give each warp the keys its private ring would, in the
    # same order: the output must equal the per-warp ring's bit for bit, and both the reference
    # (float64, naive-error rule). kv_lens 0 / 1 / mid-step / full; pages shuffled; a window
    # cutting steps mid-way; splits whose chunks end mid-step; outputs poisoned.
    from cuflash.core.problem import validate_paged
    from test_paged import paged_cache

    bn, warps, stages = shape
    rng = np.random.default_rng([ring, bn, warps, stages, len(case)])
    b, hq, hkv, nk, d = 4, 32, 8, 1700, 128
    nq = 7 if case == "window" else 1
    causal = {"lens-br": "bottom_right", "paged-tl": "top_left", "window": "bottom_right"}.get(case, False)
    window = (300, 0) if case == "window" else None
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    kw = dict(splits=1)
    if case.startswith("split"):
        kw = dict(splits=4, cluster=case == "split-cluster")
    qg, lg = cupy.asarray(q), cupy.asarray(lens)
    if case == "paged-tl":
        kc, vc, table = (cupy.asarray(a) for a in paged_cache(rng, k, v, lens, 64))
        p, block = validate_paged(qg, kc, vc, table, causal=causal)
        args, kw = (qg, kc, vc), dict(kw, paged=(table, block))
    else:
        kg, vg = cupy.asarray(k), cupy.asarray(v)
        p = validate_forward(qg, kg, vg, causal=causal, window=window)
        args = (qg, kg, vg)
    launched = _launch(monkeypatch)
    outs = []
    for r in (0, ring):
        o4 = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
        lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
        decode_kernels.forward(p, *args, o4, lse3, kv_lens=lg, tile=schedule.DecodeTile(bn, warps, stages, 2, "test", r),
                           **kw)
        outs.append((o4.get(), lse3.get()))
    assert any(e.endswith(f", {ring}>") for e in launched), launched
    check_per_sequence(outs[1][0], outs[1][1], q, k, v, lens, causal, BFLOAT16, window=window)
    np.testing.assert_array_equal(outs[1][0].view(np.uint16), outs[0][0].view(np.uint16))
    np.testing.assert_array_equal(outs[1][1], outs[0][1])


def test_one_kernel_asked_for_more_shared_memory(monkeypatch):
    # DECODE_TILES_LONG_SPLITS and DECODE_TILES_NO_SPLIT launch the same instantiation, the second
    # with more shared memory (its two-blocks-per-SM cap): fetched in that order in a fresh kernel
    # cache, the second launch must still run (the opt-in follows the larger request) and give the
    # same bits.
    from cuflash.kernels import build

    for cache in ("_modules", "_raw_modules", "_smem_optin"):
        monkeypatch.setattr(build, cache, {})
    small, large = schedule.DECODE_TILES_LONG_SPLITS[128], schedule.DECODE_TILES_NO_SPLIT[128]
    assert small.smem_bytes(128, 1) < large.smem_bytes(128, 1)
    assert plan_decode.decode_specs(BFLOAT16, 128, 1, False, True, small)[0].expression == \
        plan_decode.decode_specs(BFLOAT16, 128, 1, False, True, large)[0].expression
    rng = np.random.default_rng(77)
    b, hq, hkv, nk, d = 2, 32, 8, 900, 128
    q, k, v = random_inputs(rng, (b, hq, 1, d), (b, hkv, nk, d), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg)
    outs = []
    for tile in (small, large):
        o4 = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype)
        lse3 = cupy.full((b, hq, 1), np.nan, dtype=np.float32)
        decode_kernels.forward(p, qg, kg, vg, o4, lse3, tile=tile, splits=1)
        outs.append(o4.get())
    check_per_sequence(outs[1], lse3, q, k, v, [nk] * b, False, BFLOAT16)
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("case", ["lens", "paged", "window", "cluster", "combine"])
def test_decode_wide_heads_few_pairs(monkeypatch, d, case):
    # Head dims 192 / 256 with fewer (sequence, K/V head) pairs than SMs run the 2-warp tile
    # (schedule.DECODE_TILES_FEW_PAIRS; at d=192 only where the splits merge in a cluster) through the API: kv_lens 0, 1, mid-tile and full; a paged
    # cache with shuffled pages; a window; the splits merged in a cluster and by the combine kernel
    # (planner's choice, on a stand-in device of 8 SMs so that a small batch splits). Outputs poisoned.
    from test_paged import run_paged

    monkeypatch.setattr(device, "sm_count", lambda device_id: 8)
    launched = _launch(monkeypatch)
    t = schedule.DECODE_TILES_FEW_PAIRS[d]
    if case == "combine" and d in schedule.DECODE_FEW_PAIRS_CLUSTERS_ONLY:
        t = schedule.DECODE_TILES[d]  # (d=192, splits merged through memory: the table's 4-warp tile)
    rng = np.random.default_rng([d, len(case)])
    dtype = FLOAT16 if case in ("lens", "window") else BFLOAT16
    b, hq, hkv, nq, nk = 4, 8, 1, 2, 3000 if case != "combine" else 20000
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    if case == "paged":
        run_paged(cupy, rng, dtype, b, hq, hkv, nq, nk, d, 64, lens, "bottom_right")
    else:
        q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
        qg, kg, vg, lg = (cupy.asarray(a) for a in (q, k, v, lens))
        window = (700, 0) if case == "window" else None
        out = poison(cupy.empty(qg.shape, dtype=dtype))
        o, lse = poisoned_allocations(lambda: cuflash.attention(qg, kg, vg, causal="bottom_right", kv_lens=lg,
                                                                window=window, return_lse=True, out=out))
        check_per_sequence(o, lse, q, k, v, lens, "bottom_right", dtype, window=window)
    tile = f"{d}, 1, {t.block_n}, {t.warps}, {t.stages}, true, true"
    assert launched and tile in launched[0], launched
    if case == "cluster":  # 4 pairs on 8 SMs: 4 splits of 750 keys, merged in a 4-block cluster
        assert launched[0].startswith("attn_decode_cluster<") and launched[0].endswith(", 4>"), launched
    if case == "combine":  # 4 splits of 5000 keys: more than CLUSTER_MAX_CHUNK, merged through the workspace
        assert launched[0].startswith("attn_decode<"), launched
        plan = types.SimpleNamespace(splits=4, cluster=False, tile=t, row_tiles=1)  # (the launched tile: the merge under "auto")
        assert launched[-1].startswith("attn_decode_combine<") != plan_decode.last_split_merges(plan, hq // hkv * 2, d), launched
