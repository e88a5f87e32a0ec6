"""Sliding windows, packed sequences and kv_lens with float8_e4m3fn GPU inputs (sm_90): the e4m3
band kernel (attn_fwd_wgmma_tma_fp8_band) through cuflash.attention, against the float64 reference
of the dequantized values by tests/_fp8_cases.py's check (the project's rule, the yardstick
emulate_attention at the kernel's own rounding points and three others).

The reference's visibility is tests/_brute_mask.py's, built pair by pair from the documented
definition (a packed batch: the block-diagonal mask of its sequences over the packed arrays). Every
call writes into a NaN-poisoned out= under poisoned_allocations (lse, vt and any scratch start as
NaN bytes); rows that see no key must give o = 0 and lse = -inf exactly, and the inputs must come
back unchanged bit for bit. Packed sequences' keys start anywhere in a 32-key group of vt, so the
kernel's first key tile of a sequence also reads the previous one's keys (masked); the yardstick's
first realization emulates that tile (packed_yardstick).
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core import problem as _problem
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import fp8_forward
from cuflash.plan import hopper as plan_hopper
from cuflash.plan import schedule
from cuflash.testing import poison, poisoned_allocations, to_numpy

from _brute_mask import block_diagonal_mask, brute_visible
from _launches import record_launches
from _fp8_cases import assert_fp8_forward, batch_entry_case, make_case, packed_case, packed_yardstick, yardstick

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


@pytest.fixture(autouse=True)
def _sm90():
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the e4m3 forward kernels run on sm_90 (Hopper)")


def window_id(w):
    return "nowin" if w is None else f"w{w[0]}_{w[1]}"


def _bits(x8):
    """A NumPy e4m3 array as a CuPy uint8 array of its bits (CuPy has no float8 dtype)."""
    return cupy.asarray(np.ascontiguousarray(x8).view(np.uint8))


def _descale(d):
    return cupy.asarray(d)


def _run(q, k, v, case, *, out_shape, out_dtype=BFLOAT16, **kw):
    """cuflash.attention on e4m3 bits with the case's descales into a poisoned out=, under poisoned
    allocations; the inputs checked unchanged. Returns (o, lse) as NumPy arrays."""
    before = [to_numpy(a).tobytes() for a in (q, k, v)]
    out = poison(cupy.empty(out_shape, dtype=out_dtype))
    od = None if np.dtype(out_dtype) == BFLOAT16 else out_dtype

    def call():
        return cuflash.attention(q, k, v, q_descale=_descale(case["qd"]), k_descale=_descale(case["kd"]),
                                 v_descale=_descale(case["vd"]), out=out, out_dtype=od, return_lse=True, **kw)

    o, lse = poisoned_allocations(call)
    assert o is out
    assert [to_numpy(a).tobytes() for a in (q, k, v)] == before, "an input was modified"
    return to_numpy(o), to_numpy(lse)


def _tile(d, out_dtype=BFLOAT16):
    """(block_n, k32 steps of S) of the band kernel that runs head dim d."""
    _, t = plan_hopper.fp8_forward_band_spec(out_dtype, d)
    return t.block_n, schedule.fp8_head_dim(d) // 32


def _assert_hidden_rows(o, lse, vis, rows_axis):
    """Rows that see no key: o exactly 0 and lse -inf."""
    hidden = ~vis.any(axis=1)
    assert np.all(np.moveaxis(o.astype(np.float32), rows_axis, 0)[hidden] == 0), "rows that see no key: o = 0"
    assert np.all(np.moveaxis(lse, -1, 0)[hidden] == -np.inf), "rows that see no key: lse = -inf"


def window_check(rng, b, hq, hkv, nq, nk, d, causal, window, *, layout="bhsd", granularity="head",
                 q_per_kv_head=False, out_dtype=BFLOAT16):
    case = make_case(rng, b, hq, hkv, nq, nk, d, granularity=granularity, layout=layout, q_per_kv_head=q_per_kv_head)
    q, k, v = (_bits(case[n + "8"]) for n in "qkv")
    o, lse = _run(q, k, v, case, out_shape=case["q8"].shape, out_dtype=out_dtype, causal=causal, window=window,
                  layout=layout)
    vis = brute_visible(causal, window, nq, nk)
    block_n, steps = _tile(d, out_dtype)
    yards = yardstick(case, causal=causal, block_n=block_n, out_dtype=np.dtype(out_dtype), window=window)
    assert_fp8_forward(o, lse, case, causal=False, block_n=block_n, steps=steps, out_dtype=np.dtype(out_dtype),
                       mask=vis, yards=yards)
    _assert_hidden_rows(o, lse, vis, -2 if layout == "bhsd" else -3)


# ----------------------------------------------------------------------------- windows

# Both sides bounded and cutting the 128 x 128 tiles mid-way, zero-width (narrower than any tile),
# a few keys, one-sided (right only, left only), and a right side reaching past the end.
WINDOWS = [(70, 20), (0, 0), (3, 0), (-1, 5), (130, -1), (3, 200)]


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS, ids=window_id)
@pytest.mark.parametrize("nq, nk", [(300, 333), (333, 300)])
def test_window(rng, d, causal, window, nq, nk):
    # GQA 4:2, batch 2, lengths no multiple of the tiles or of vt's 32-key groups; with Nq > Nk
    # bottom-right or a zero-width window some rows see no key.
    window_check(rng, 2, 4, 2, nq, nk, d, causal, window)


@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (False, (150, 150)), ("top_left", (0, -1)),
                                            (False, (200, 7))])
def test_window_long_rows(rng, causal, window):
    # Many query and key tiles: tiles left of the band are never loaded (the key coordinate starts
    # at the first visible tile), tiles inside it need no mask.
    window_check(rng, 1, 2, 2, 900, 1000, 128, causal, window)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d", [64, 96, 200])
def test_window_layouts_head_dims_and_descales(rng, layout, d):
    # d = 64 / 96 run the 128 kernel, 200 the 256 one, on zero-filled columns; q's descale per
    # (batch, K/V head); MQA over 3 query heads; both output dtypes.
    for out_dtype in (BFLOAT16, FLOAT16):
        window_check(rng, 3, 3, 1, 130, 190, d, "bottom_right", (37, 5), layout=layout, q_per_kv_head=True,
                     out_dtype=out_dtype)


def test_window_per_tensor_descales_and_scale(rng):
    case = make_case(rng, 2, 2, 2, 140, 100, 128, granularity="tensor")
    q, k, v = (_bits(case[n + "8"]) for n in "qkv")
    o, lse = _run(q, k, v, case, out_shape=case["q8"].shape, window=(20, 20), scale=0.05)
    block_n, steps = _tile(128)
    yards = yardstick(case, causal=False, block_n=block_n, out_dtype=np.dtype(BFLOAT16), window=(20, 20), scale=0.05)
    assert_fp8_forward(o, lse, case, causal=False, block_n=block_n, steps=steps, out_dtype=np.dtype(BFLOAT16),
                       scale=0.05, mask=brute_visible(False, (20, 20), 140, 100), yards=yards)


def test_window_runs_the_band_kernel_and_no_window_the_plain_one(rng, monkeypatch):
    launched = record_launches(monkeypatch, fp8_forward)
    window_check(rng, 1, 2, 2, 64, 64, 128, True, (16, 0))
    window_check(rng, 1, 2, 2, 64, 64, 128, True, (-1, -1))  # (no window)
    kernels = [e for e in launched if e.startswith("attn_fwd")]
    assert len(kernels) == 2, launched
    # (without a window: the dense kernel the dispatch picks, causal d=128's persistent one where the table has it)
    dense = plan_hopper.fp8_forward_spec(BFLOAT16, 128, True)[0].expression
    assert kernels[0].startswith("attn_fwd_wgmma_tma_fp8_band<") and kernels[1] == dense


# ----------------------------------------------------------------------------- packed sequences

# Nq of 1, 2, 7, 16 per sequence and no multiples of 32 (so sequences start anywhere in a key
# group), empty sequences on either side and both, Nq > Nk and Nq < Nk, sequences of several
# 128-row and 128-key tiles.
BATCHES = [
    pytest.param([1, 0, 2, 7, 16, 0, 300], [9, 4, 0, 3, 40, 0, 290], id="mixed"),
    pytest.param([16, 1, 2, 7, 270], [16, 30, 1, 7, 400], id="no-empty"),
    pytest.param([0, 7, 0], [0, 20, 5], id="leading-empty"),
    pytest.param([33, 100, 1], [31, 161, 97], id="odd-starts"),
]


def varlen_check(rng, nqs, nks, causal, window, *, hq=4, hkv=2, d=128, out_dtype=BFLOAT16, lengths=None):
    """``lengths``: max_seqlen_q / max_seqlen_k / validate=False to pass, with every host read of an
    argument (core.problem.to_host) failing the call."""
    case, cq, ck = packed_case(rng, nqs, nks, hq, hkv, d)
    q, k, v = (_bits(case[n + "8"][0]) for n in "qkv")
    cq_d, ck_d = cupy.asarray(cq), cupy.asarray(ck)
    before = [to_numpy(a).tobytes() for a in (cq_d, ck_d)]
    with pytest.MonkeyPatch.context() as mp:
        if lengths:
            mp.setattr(_problem, "to_host", lambda a, name, why: pytest.fail(f"{name} was read on the host"))
        o, lse = _run(q, k, v, case, out_shape=q.shape, out_dtype=out_dtype, causal=causal, window=window,
                      cu_seqlens_q=cq_d, cu_seqlens_k=ck_d, **(lengths or {}))
    assert [to_numpy(a).tobytes() for a in (cq_d, ck_d)] == before
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0]) and lse.dtype == np.float32
    vis = block_diagonal_mask(causal, window, cq, ck)
    block_n, steps = _tile(d, out_dtype)
    yards = packed_yardstick(case, cq, ck, causal=causal, window=window, block_n=block_n,
                             out_dtype=np.dtype(out_dtype))
    assert_fp8_forward(o[None], lse[None], case, causal=False, block_n=block_n, steps=steps,
                       out_dtype=np.dtype(out_dtype), mask=vis, yards=yards)
    _assert_hidden_rows(o, lse, vis, 0)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [None, (3, 0), (2, 2), (-1, 1), (50, -1)], ids=window_id)
@pytest.mark.parametrize("nqs, nks", BATCHES)
def test_varlen(rng, causal, window, nqs, nks):
    varlen_check(rng, nqs, nks, causal, window)


@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 1), (128, 8, 2), (200, 4, 4), (256, 2, 1)])
def test_varlen_head_dims_and_groups(rng, d, hq, hkv):
    varlen_check(rng, [3, 150, 0, 16, 45], [40, 140, 9, 16, 77], True, None, hq=hq, hkv=hkv, d=d)
    varlen_check(rng, [3, 150, 0, 16, 45], [40, 140, 9, 16, 77], False, (30, 2), hq=hq, hkv=hkv, d=d,
                 out_dtype=FLOAT16)


@pytest.mark.parametrize("slack", [0, 100], ids=["exact", "longer"])
def test_varlen_max_seqlens_read_no_offsets(rng, slack):
    # max_seqlen_q / max_seqlen_k with validate=False size the grid: no offset is read on the host,
    # and the result meets the same yardstick.
    nqs, nks = [3, 150, 0, 16, 45], [40, 140, 9, 16, 77]
    varlen_check(rng, nqs, nks, True, None, lengths=dict(max_seqlen_q=max(nqs) + slack,
                                                          max_seqlen_k=max(nks) + slack, validate=False))


def test_varlen_is_one_launch(rng, monkeypatch):
    launched = record_launches(monkeypatch, fp8_forward)
    varlen_check(rng, [1, 2, 7, 16, 130], [5, 2, 20, 16, 140], "bottom_right", None)
    kernels = [e for e in launched if e.startswith("attn_fwd")]
    assert len(kernels) == 1 and kernels[0].startswith("attn_fwd_wgmma_tma_fp8_band<"), launched


def test_varlen_strided_out(rng):
    # out= a slice of a larger poisoned array: the kernel writes through its strides, and nothing
    # outside the view.
    case, cq, ck = packed_case(rng, [9, 130], [20, 100], 2, 2, 128)
    q, k, v = (_bits(case[n + "8"][0]) for n in "qkv")
    big = poison(cupy.empty((q.shape[0], 3, 144), dtype=BFLOAT16))
    out = big[:, 1:, 8:136]
    o, lse = cuflash.attention(q, k, v, q_descale=_descale(case["qd"]), k_descale=_descale(case["kd"]),
                               v_descale=_descale(case["vd"]), causal=True, cu_seqlens_q=cupy.asarray(cq),
                               cu_seqlens_k=cupy.asarray(ck), out=out, return_lse=True)
    assert o is out
    block_n, steps = _tile(128)
    yards = packed_yardstick(case, cq, ck, causal=True, window=None, block_n=block_n, out_dtype=np.dtype(BFLOAT16))
    assert_fp8_forward(to_numpy(o)[None], to_numpy(lse)[None], case, causal=False, block_n=block_n, steps=steps,
                       out_dtype=np.dtype(BFLOAT16), mask=block_diagonal_mask(True, None, cq, ck), yards=yards)
    rest = to_numpy(big).view(np.uint16).copy()
    rest[:, 1:, 8:136] = 0xFFFF
    assert np.all(rest == 0xFFFF), "the forward wrote outside out="


def test_varlen_takes_one_descale_per_tensor(rng):
    case, cq, ck = packed_case(rng, [3, 4], [5, 6], 2, 2, 128)
    q, k, v = (_bits(case[n + "8"][0]) for n in "qkv")
    with pytest.raises(ValueError, match=r"^k_descale: expected shape \(\) \(packed sequences take one factor"):
        cuflash.attention(q, k, v, k_descale=cupy.ones((2,), np.float32), cu_seqlens_q=cupy.asarray(cq),
                          cu_seqlens_k=cupy.asarray(ck))


# ----------------------------------------------------------------------------- kv_lens


@pytest.mark.parametrize("causal, window", [("bottom_right", None), (False, None), (True, (40, 0)),
                                            ("top_left", (10, 10))], ids=["br", "full", "br-w40_0", "tl-w10_10"])
def test_kv_lens(rng, causal, window):
    # Each batch entry over its first kv_lens[b] keys (an empty one among them), the causal and
    # window alignment its own; per-(batch, head) descales read at each entry's row.
    b, hq, hkv, nq, nk, d = 3, 4, 2, 130, 333, 128
    case = make_case(rng, b, hq, hkv, nq, nk, d, granularity="head")
    q, k, v = (_bits(case[n + "8"]) for n in "qkv")
    lens = np.array([0, 150, 333], dtype=np.int32)
    o, lse = _run(q, k, v, case, out_shape=case["q8"].shape, causal=causal, window=window,
                  kv_lens=cupy.asarray(lens))
    block_n, steps = _tile(d)
    for i, n in enumerate(lens.tolist()):
        sl = slice(i, i + 1)
        if n == 0:
            assert np.all(o[sl].astype(np.float32) == 0) and np.all(lse[sl] == -np.inf)
            continue
        entry = batch_entry_case(case, i, n)
        yards = yardstick(entry, causal=causal, block_n=block_n, out_dtype=np.dtype(BFLOAT16), window=window)
        assert_fp8_forward(o[sl], lse[sl], entry, causal=False, block_n=block_n, steps=steps,
                           out_dtype=np.dtype(BFLOAT16), mask=brute_visible(causal, window, nq, n), yards=yards)
