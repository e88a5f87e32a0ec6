"""The e4m3 forward kernel (attn_fwd_wgmma_tma_fp8, sm_90) through cuflash.attention: float8_e4m3fn
q, k, v as CuPy uint8 bits with their descales, against the float64 reference of the dequantized
values by tests/_fp8_cases.py's check (the project's rule with emulate_attention's arithmetic at
the kernel's own rounding points as the yardstick; its docstring derives the bound).

Every call writes into a NaN-poisoned out= and runs under poisoned_allocations (lse, vt and any
scratch start as NaN bytes), and the inputs are compared bit for bit afterwards. Shapes: GQA and
MQA, batch > 1, lengths that are no multiple of the tiles, d = 128 and 256 (and head dims that run
those kernels on zero-filled columns), both layouts, per-tensor and per-head descales (q's also per
K/V head), both output dtypes, unaligned and strided inputs, rows that see no key.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.plan import hopper as plan_hopper
from cuflash.plan import schedule
from cuflash.testing import poison, poisoned_allocations, to_numpy

from _fp8_cases import assert_fp8_forward, make_case

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm90():
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the e4m3 forward kernel runs on sm_90 (Hopper)")


def _bits(x8):
    """A NumPy e4m3 array as a CuPy uint8 array of its bits (CuPy has no float8 dtype)."""
    return cupy.asarray(np.ascontiguousarray(x8).view(np.uint8))


def _descale(d):
    return None if d is None else cupy.asarray(d)


def _run(case, *, causal, out_dtype=BFLOAT16, with_lse=True, arrays=None, **kw):
    """cuflash.attention on the case's bits (``arrays``: other views of them) into a poisoned out=,
    under poisoned allocations. Returns (o, lse) as NumPy arrays (lse None without with_lse)."""
    q, k, v = arrays if arrays is not None else (_bits(case[n + "8"]) for n in "qkv")
    before = [to_numpy(a).tobytes() for a in (q, k, v)]
    out = poison(cupy.empty(case["q8"].shape, dtype=out_dtype))
    od = None if np.dtype(out_dtype) == BFLOAT16 else out_dtype

    def call():
        return cuflash.attention(q, k, v, q_descale=_descale(case["qd"]), k_descale=_descale(case["kd"]),
                                 v_descale=_descale(case["vd"]), causal=causal, layout=case["layout"], out=out,
                                 out_dtype=od, return_lse=with_lse, **kw)

    res = poisoned_allocations(call)
    o, lse = res if with_lse else (res, None)
    assert o is out
    assert [to_numpy(a).tobytes() for a in (q, k, v)] == before, "an input was modified"
    return to_numpy(o), None if lse is None else to_numpy(lse)


def _check(o, lse, case, *, causal, d, out_dtype=BFLOAT16, scale=None):
    spec, t = plan_hopper.fp8_forward_spec(out_dtype, d, causal is not False)
    steps = schedule.fp8_head_dim(d) // 32
    return assert_fp8_forward(o, lse, case, causal=causal, block_n=t.block_n, steps=steps, out_dtype=np.dtype(out_dtype),
                              scale=scale)


CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_matches_the_reference(rng, d, causal, granularity):
    # GQA (2 query heads per K/V head), batch 2, lengths no multiple of the 128-key tile or of vt's
    # 32-key groups, nq != nk.
    case = make_case(rng, 2, 4, 2, 300, 333, d, granularity=granularity)
    o, lse = _run(case, causal=causal)
    _check(o, lse, case, causal=causal, d=d)


@pytest.mark.parametrize("d, pingpong", [(128, False), (128, True), (256, False), (256, True)])
def test_both_schedules_of_each_tile(rng, monkeypatch, d, pingpong):
    # The table's tile and its twin with the other schedule (ping-pong turns or own pace): both are
    # compiled in CI and selectable.
    t = schedule.HOPPER_FP8_FORWARD_TILES[d]
    monkeypatch.setattr(schedule, "HOPPER_FP8_FORWARD_PERSISTENT", {})  # (the per-tile kernel runs the table's tile)
    monkeypatch.setitem(schedule.HOPPER_FP8_FORWARD_TILES, d, schedule.HopperTile(
        t.block_n, t.warpgroups, t.stages, "test", tma=True, pingpong=pingpong))
    case = make_case(rng, 2, 4, 1, 257, 515, d, granularity="head")
    for causal in (False, "bottom_right"):
        o, lse = _run(case, causal=causal)
        _check(o, lse, case, causal=causal, d=d)


@pytest.mark.parametrize("block_n", plan_hopper.FP8_KEY_TILES)
def test_every_key_tile(rng, monkeypatch, block_n):
    # Each key tile the kernel takes (160-224 keys: vt's slot two whole 128-key boxes, the keys past
    # the tile loaded and unused), with lengths that end inside a tile, inside its last vt box and
    # past vt's last group.
    monkeypatch.setattr(schedule, "HOPPER_FP8_FORWARD_PERSISTENT", {})
    monkeypatch.setitem(schedule.HOPPER_FP8_FORWARD_TILES, 128, schedule.HopperTile(block_n, 2, 2, "test", tma=True))
    case = make_case(rng, 1, 4, 2, 291, 2 * block_n + 101, 128, granularity="head")
    for causal in (False, "bottom_right", "top_left"):
        o, lse = _run(case, causal=causal)
        _check(o, lse, case, causal=causal, d=128)


@pytest.mark.parametrize("nk, d, strided", [(1, 128, False), (200, 128, False), (333, 256, False), (4099, 64, False),
                                             (130, 200, False), (77, 100, True), (300, 128, True)])
def test_vt_against_its_definition(rng, nk, d, strided):
    # fp8_pack_vt against vt[bh, c, p] = v[bh, 32 (p // 32) + KEY_OF_POS[p % 32], c], zeros past nk:
    # 16-byte loads (d a multiple of 16) and byte loads (d = 100, a strided v), several blocks of
    # keys and columns, columns past d unwritten, into a poisoned allocation.
    from cuflash.kernels import fp8_forward

    b, h = 2, 3
    bits = rng.integers(0, 256, size=(b, h, 2 * nk if strided else nk, d + (5 if strided else 0)), dtype=np.uint8)
    v_host = bits[:, :, ::2, :d] if strided else bits
    v = cupy.asarray(bits)[:, :, ::2, :d] if strided else cupy.asarray(bits)
    vt = to_numpy(poisoned_allocations(lambda: fp8_forward.pack_vt(v)))
    nk_pad = plan_hopper.vt_keys(nk)
    want = np.zeros((b, h, d, nk_pad), np.uint8)
    p = np.arange(nk_pad)
    key = 32 * (p // 32) + np.asarray(fp8_forward.KEY_OF_POS)[p % 32]
    inside = key < nk
    want[..., inside] = np.swapaxes(v_host, 2, 3)[..., key[inside]]
    assert vt.shape == want.shape
    np.testing.assert_array_equal(vt, want)


@pytest.mark.parametrize("block_n, stages, wg_epilogue", [(224, 3, True), (224, 3, False), (128, 2, True)])
def test_persistent_tiles(rng, monkeypatch, block_n, stages, wg_epilogue):
    # The persistent kernel (attn_fwd_wgmma_tma_fp8_persistent) with 3 blocks, so that each walks
    # tiles of several (batch entry, head) pairs - and their own descales (per head: a block that
    # kept its first tile's scale would be wrong on every later one) - and carries its K/V ring
    # and barrier phases across them; O stored from the accumulators into the poisoned out= (a
    # row or column left unwritten stays NaN); GQA, lengths no multiple of the tiles.
    from cuflash.kernels import device

    tile = schedule.HopperTile(block_n, 2, stages, "test", tma=True, persistent=True, wg_epilogue=wg_epilogue)
    monkeypatch.setattr(schedule, "HOPPER_FP8_FORWARD_PERSISTENT", {(128, False): tile, (128, True): tile})
    monkeypatch.setattr(device, "sm_count", lambda device_id: 3)
    case = make_case(rng, 2, 4, 2, 300, 2 * block_n + 77, 128, granularity="head")
    assert plan_hopper.fp8_forward_spec(BFLOAT16, 128, False)[0].expression.startswith(
        "attn_fwd_wgmma_tma_fp8_persistent<")
    for causal in (False, "bottom_right", "top_left"):
        o, lse = _run(case, causal=causal)
        _check(o, lse, case, causal=causal, d=128)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d", [64, 96, 200])
def test_layouts_head_dims_and_q_descale_per_kv_head(rng, layout, d):
    # d = 64 / 96 run the 128 kernel, 200 the 256 one, on columns the copy engine zero-fills; q's
    # descale per (batch, K/V head) as FlashAttention-3 takes it; MQA over 3 query heads; float16 o.
    case = make_case(rng, 3, 3, 1, 130, 190, d, granularity="head", layout=layout, q_per_kv_head=True)
    for out_dtype in (BFLOAT16, FLOAT16):
        o, lse = _run(case, causal="top_left", out_dtype=out_dtype)
        _check(o, lse, case, causal="top_left", d=d, out_dtype=out_dtype)


def test_unaligned_and_strided_inputs(rng):
    # d = 100: rows of 100 bytes, which TMA cannot address (q and k are copied with zero columns
    # to 112) and o's rows are no whole 16-byte chunks (a scratch o); v a strided view (its byte
    # loads); a non-default scale.
    b, hq, hkv, nq, nk, d = 2, 2, 2, 140, 100, 100
    case = make_case(rng, b, hq, hkv, nq, nk, d, granularity="tensor")
    q, k = _bits(case["q8"]), _bits(case["k8"])
    wide_v = cupy.zeros((b, hkv, 2 * nk, d + 5), dtype=np.uint8)
    wide_v[:, :, ::2, :d] = _bits(case["v8"])
    v = wide_v[:, :, ::2, :d]
    o, lse = _run(case, causal=False, arrays=(q, k, v), scale=0.05)
    _check(o, lse, case, causal=False, d=d, scale=0.05)


def test_rows_without_keys_and_no_keys(rng):
    # bottom-right causal with nq > nk: the first nq - nk rows see no key (o = 0, lse = -inf);
    # nk = 0: every row.
    case = make_case(rng, 2, 2, 2, 200, 70, 128, granularity="head")
    o, lse = _run(case, causal="bottom_right")
    _check(o, lse, case, causal="bottom_right", d=128)
    assert np.all(o[:, :, :130] == 0) and np.all(lse[:, :, :130] == -np.inf)
    empty = make_case(rng, 1, 2, 2, 5, 0, 128, granularity="tensor")
    o, lse = _run(empty, causal=False)
    assert np.all(o == 0) and np.all(lse == -np.inf)


def test_without_descales_the_factors_are_1(rng):
    # e4m3 bits with descales of 1 given explicitly (what marks uint8 CuPy arrays as e4m3) and the
    # same call with only v's: per-tensor 1 and the null factors agree bit for bit. (The raw e4m3
    # values reach +-448: a small scale keeps the scores' spread about the cases' above.)
    case = make_case(rng, 1, 2, 2, 64, 96, 128, granularity="tensor")
    q, k, v = (_bits(case[n + "8"]) for n in "qkv")
    one = cupy.ones((), dtype=np.float32)
    scale = 1e-5
    a = cuflash.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one, scale=scale)
    b = cuflash.attention(q, k, v, v_descale=one, scale=scale)
    assert to_numpy(a).tobytes() == to_numpy(b).tobytes()
    ones = dict(case, qd=np.ones((), np.float32), kd=np.ones((), np.float32), vd=np.ones((), np.float32))
    _check(to_numpy(a), None, ones, causal=False, d=128, scale=scale)


def test_torch_float8_tensors(rng):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    case = make_case(rng, 2, 4, 2, 100, 150, 128, granularity="head")
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(case[n + "8"]).view(np.uint8)).cuda().view(torch.float8_e4m3fn)
                  for n in "qkv")
    td = [torch.from_numpy(case[n]).cuda() for n in ("qd", "kd", "vd")]
    o, lse = cuflash.attention(tq, tk, tv, q_descale=td[0], k_descale=td[1], v_descale=td[2], causal=True,
                               return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = _run(case, causal=True)
    torch.cuda.synchronize()
    assert o.view(torch.int16).cpu().numpy().tobytes() == want.view(np.int16).tobytes()
    assert lse.cpu().numpy().tobytes() == want_lse.tobytes()


def test_gpu_refusals_name_the_option(rng):
    case = make_case(rng, 1, 2, 2, 16, 16, 128, granularity="tensor")
    q, k, v = (_bits(case[n + "8"]) for n in "qkv")
    one = cupy.ones((), dtype=np.float32)
    with pytest.raises(NotImplementedError, match="^softcap:"):
        cuflash.attention(q, k, v, k_descale=one, softcap=5.0)
    with pytest.raises(NotImplementedError, match="^out_dtype:"):
        cuflash.attention(q, k, v, k_descale=one, out_dtype=np.float32)
    with pytest.raises(TypeError, match="^k_descale: is a NumPy array but q is a CuPy array"):
        cuflash.attention(q, k, v, k_descale=np.ones((), np.float32))
    with pytest.raises(TypeError, match="^k_descale: expected dtype float32"):
        cuflash.attention(q, k, v, k_descale=cupy.ones((), np.float64))
    with pytest.raises(ValueError, match="^v_descale: expected shape"):
        cuflash.attention(q, k, v, v_descale=cupy.ones((2, 2), np.float32))
