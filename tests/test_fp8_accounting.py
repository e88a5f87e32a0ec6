"""memory_report and io_model of float8_e4m3fn q, k, v (the e4m3 forward: backends.cuda.forward_fp8,
kernels.fp8_forward): every byte the call allocates and moves, against counts written here from
the launcher's rules (vt of Nk rounded up to 32 keys, the zero-padded copies TMA needs, the O
scratch of d % 8 != 0), and the errors that name their argument. CPU only."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import accounting
from cuflash.backends import reference
from cuflash.core import masks
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.fp8_inputs import E4M3
from cuflash.plan import hopper as plan_hopper

E4 = "float8_e4m3fn"


def up(n, m):
    return -(-n // m) * m


def entries(rep):
    names = [e.name for e in rep.entries]
    assert len(names) == len(set(names)), names
    return {e.name: e for e in rep.entries}


def dims(q_shape, k_shape, layout):
    """(batch, hq, nq, hkv, nk, d) of dense shapes, read here from the layout's definition."""
    if len(q_shape) == 2:
        return 1, 1, q_shape[0], 1, k_shape[0], q_shape[1]
    b = math.prod(q_shape[:-3])
    if layout == "bhsd":
        (hq, nq, d), (hkv, nk, _) = q_shape[-3:], k_shape[-3:]
    else:
        (nq, hq, d), (nk, hkv, _) = q_shape[-3:], k_shape[-3:]
    return b, hq, nq, hkv, nk, d


def expected_tiled(b, hq, nq, hkv, nk, d, out_dtype, q_copy, k_copy):
    """Device bytes of one e4m3 forward call on contiguous inputs, by name."""
    osz = np.dtype(out_dtype).itemsize
    want = {"Q": b * hq * nq * d, "K": b * hkv * nk * d, "V": b * hkv * nk * d,
            "O": b * hq * nq * d * osz, "LSE": 4 * b * hq * nq,
            "vt": b * hkv * d * up(nk, 32)}  # uint8 (B, Hkv, d, Nk rounded up to 32)
    if q_copy:
        want["Q (zero-padded copy)"] = b * hq * nq * up(d, 16)
    if k_copy:
        want["K (zero-padded copy)"] = b * hkv * nk * up(d, 16)
    if d % 8:
        want["O (scratch)"] = b * hq * nq * up(d, 8) * osz
    return want


def device_part(rep):
    return {e.name: e.bytes for e in rep.entries if e.category != accounting.ON_CHIP}


DENSE = [
    # q shape, k shape, layout, out dtype
    ((2, 8, 1000, 128), (2, 8, 1000, 128), "bhsd", None),
    ((2, 8, 300, 64), (2, 2, 1000, 64), "bhsd", FLOAT16),  # GQA 4, Nk not a multiple of 32
    ((1, 4, 257, 256), (1, 1, 333, 256), "bhsd", BFLOAT16),  # MQA
    ((3, 500, 8, 128), (3, 999, 4, 128), "bshd", FLOAT16),
    ((2, 3, 4, 100, 72), (2, 3, 2, 130, 72), "bhsd", None),  # two batch axes; d % 16 != 0: copies of q and k
    ((2, 77, 4, 100), (2, 45, 4, 100), "bshd", FLOAT16),  # d % 8 != 0 too: the O scratch
    ((100, 40), (70, 40), "bhsd", None),  # one head (N, d)
]


@pytest.mark.parametrize("q_shape, k_shape, layout, out_dtype", DENSE)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_dense_bytes(q_shape, k_shape, layout, out_dtype, causal):
    b, hq, nq, hkv, nk, d = dims(q_shape, k_shape, layout)
    rep = accounting.memory_report(q_shape, k_shape, dtype=E4, causal=causal, layout=layout, out_dtype=out_dtype)
    # contiguous rows of d bytes: TMA steps them only at multiples of 16 (here every such shape has N > 1)
    want = expected_tiled(b, hq, nq, hkv, nk, d, out_dtype or BFLOAT16, d % 16 != 0, d % 16 != 0)
    assert device_part(rep) == want
    assert rep.device_bytes == sum(want.values())
    assert rep.dtype == E4 and rep.total(accounting.INPUT) == want["Q"] + want["K"] + want["V"]
    spec, _ = plan_hopper.fp8_forward_spec(out_dtype or BFLOAT16, d, causal)
    smem = entries(rep)["shared memory / block (fwd)"]
    assert smem.bytes == spec.smem_bytes and spec.short_name in smem.note


def test_e4m3_arrays_and_uint8_bits_read_as_shapes():
    q8 = np.zeros((2, 4, 50, 64), dtype=E4M3)
    k8 = np.zeros((2, 2, 70, 64), dtype=E4M3)
    by_shape = accounting.memory_report(q8.shape, k8.shape, dtype=E4)
    assert accounting.memory_report(q8, k8, k8).entries == by_shape.entries
    bits = [a.view(np.uint8) for a in (q8, k8, k8)]
    assert accounting.memory_report(*bits, dtype=E4).entries == by_shape.entries
    # a descale marks uint8 bits as e4m3, as cuflash.attention takes them (and is an input itself)
    rep = accounting.memory_report(*bits, q_descale=np.ones((), np.float32))
    assert device_part(rep) == dict(device_part(by_shape), q_descale=4)


def test_copies_only_where_an_axis_is_stepped():
    # d = 72: q's one row of one head is never stepped (TMA's nominal strides); k's rows are.
    rep = entries(accounting.memory_report((1, 1, 1, 72), (1, 1, 300, 72), dtype=E4))
    assert "Q (zero-padded copy)" not in rep
    assert rep["K (zero-padded copy)"].bytes == 300 * 80
    # bshd with Nq = 1: q's heads are d = 72 bytes apart
    rep = entries(accounting.memory_report((2, 1, 4, 72), (2, 300, 4, 72), dtype=E4, layout="bshd"))
    assert rep["Q (zero-padded copy)"].bytes == 2 * 4 * 1 * 80


def test_no_workspace_without_work():
    for q_shape, k_shape in (((2, 4, 0, 128), (2, 4, 64, 128)), ((2, 4, 64, 72), (2, 4, 0, 72))):
        rep = entries(accounting.memory_report(q_shape, k_shape, dtype=E4))
        assert not [n for n, e in rep.items() if e.category == accounting.WORKSPACE]
        b, hq, nq = q_shape[:3]
        assert rep["O"].bytes == 2 * b * hq * nq * q_shape[3] and rep["LSE"].bytes == 4 * b * hq * nq


@pytest.mark.parametrize("window", [(64, 0), (10, 10)])
def test_window_runs_the_band_kernel(window):
    rep = accounting.memory_report((1, 4, 300, 128), (1, 4, 300, 128), dtype=E4, window=window)
    spec, _ = plan_hopper.fp8_forward_band_spec(BFLOAT16, 128)
    smem = entries(rep)["shared memory / block (fwd)"]
    assert "band" in spec.short_name and spec.short_name in smem.note and smem.bytes == spec.smem_bytes
    assert device_part(rep) == expected_tiled(1, 4, 300, 4, 300, 128, BFLOAT16, False, False)


@pytest.mark.parametrize("d, hq, hkv, out_dtype", [(128, 8, 2, None), (64, 4, 4, FLOAT16), (256, 2, 1, None),
                                                    (100, 4, 2, None), (96, 6, 3, FLOAT16)])
def test_packed_bytes(d, hq, hkv, out_dtype):
    nqs, nks = [100, 1, 257], [300, 33, 7]
    cq, ck = np.cumsum([0] + nqs), np.cumsum([0] + nks)
    tq, tk = int(cq[-1]), int(ck[-1])
    rep = accounting.memory_report((tq, hq, d), (tk, hkv, d), dtype=E4, cu_seqlens_q=cq.astype(np.int32),
                                   cu_seqlens_k=list(ck), out_dtype=out_dtype)
    # (1, H, total, d) views: rows H*d bytes apart, heads d bytes apart
    copy = (hq * d) % 16 != 0 or d % 16 != 0
    want = expected_tiled(1, hq, tq, hkv, tk, d, out_dtype or BFLOAT16, copy, (hkv * d) % 16 != 0 or d % 16 != 0)
    want.update(cu_seqlens_q=4 * 4, cu_seqlens_k=4 * 4)
    assert device_part(rep) == want
    spec, _ = plan_hopper.fp8_forward_band_spec(out_dtype or BFLOAT16, d)
    assert entries(rep)["shared memory / block (fwd)"].bytes == spec.smem_bytes
    # offsets unread on the host (both maxima, validate=False): their clamped copies, 2 x 4 int32;
    # one maximum or validate=True reads them and allocates nothing more
    unread = accounting.memory_report((tq, hq, d), (tk, hkv, d), dtype=E4, cu_seqlens_q=cq.astype(np.int32),
                                      cu_seqlens_k=list(ck), out_dtype=out_dtype, max_seqlen_q=257,
                                      max_seqlen_k=300, validate=False)
    assert device_part(unread) == dict(want, **{"offsets (clamped)": 2 * 4 * 4})
    for lengths in (dict(max_seqlen_q=257, validate=False), dict(max_seqlen_q=257, max_seqlen_k=300)):
        assert device_part(accounting.memory_report((tq, hq, d), (tk, hkv, d), dtype=E4,
                                                    cu_seqlens_q=cq.astype(np.int32), cu_seqlens_k=list(ck),
                                                    out_dtype=out_dtype, **lengths)) == want


@pytest.mark.parametrize("descales, extra", [
    (dict(q_descale=(), k_descale=(1,), v_descale=np.ones((), np.float32)), 12),
    (dict(q_descale=(2, 8), k_descale=(2, 2), v_descale=np.ones((2, 2), np.float32)), 4 * (16 + 4 + 4)),
    (dict(q_descale=(2, 2)), 16),  # q per K/V head (FlashAttention-3's)
])
def test_descales_are_inputs(descales, extra):
    base = accounting.memory_report((2, 8, 64, 128), (2, 2, 64, 128), dtype=E4)
    rep = accounting.memory_report((2, 8, 64, 128), (2, 2, 64, 128), dtype=E4, **descales)
    assert rep.total(accounting.INPUT) == base.total(accounting.INPUT) + extra
    assert rep.device_bytes == base.device_bytes + extra


def test_reference_materializes_the_dequantized_inputs():
    b, hq, hkv, nq, nk, d = 2, 8, 4, 100, 300, 64
    rep = accounting.memory_report((b, hq, nq, d), (b, hkv, nk, d), dtype=E4, method="reference")
    nn = b * hq * nq * nk
    want = {"Q": b * hq * nq * d, "K": b * hkv * nk * d, "V": b * hkv * nk * d, "O": 2 * b * hq * nq * d,
            "LSE": 4 * b * hq * nq, "Q (dequantized)": 4 * b * hq * nq * d, "K (dequantized)": 4 * b * hkv * nk * d,
            "V (dequantized)": 4 * b * hkv * nk * d, "O (float32)": 4 * b * hq * nq * d, "S": 4 * nn, "P": 4 * nn}
    assert device_part(rep) == want
    assert rep.device_bytes_in_place == sum(want.values()) - 4 * nn
    # what the report says the reference gives: o in bfloat16, lse in float32
    rng = np.random.default_rng(0)
    q8, k8, v8 = (rng.standard_normal(s).astype(E4M3) for s in ((1, 2, 5, 16), (1, 1, 7, 16), (1, 1, 7, 16)))
    o, lse = reference.attention(q8, k8, v8, return_lse=True)
    assert o.dtype == BFLOAT16 and lse.dtype == FLOAT32


def test_flops_take_e4m3_shapes_as_any():
    f = cuflash.flops((2, 8, 300, 128), (2, 2, 333, 128), causal=True)
    assert f.flops == 4 * 128 * 2 * 8 * sum(min(333, i + 33 + 1) for i in range(300))


@pytest.mark.parametrize("pass_", ["bwd", "fwd+bwd"])
@pytest.mark.parametrize("method", ["tiled", "reference"])
def test_no_e4m3_backward(pass_, method):
    with pytest.raises(ValueError, match="pass_"):
        accounting.memory_report((1, 2, 64, 128), (1, 2, 64, 128), dtype=E4, pass_=pass_, method=method)
    if method == "tiled":
        with pytest.raises(ValueError, match="pass_"):
            accounting.io_model((1, 2, 64, 128), dtype=E4, pass_=pass_)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(k_descale=(2, 8)), ValueError, "k_descale"),  # k has 2 heads
    (dict(q_descale=(8,)), ValueError, "q_descale"),  # missing the batch axis
    (dict(v_descale=np.ones((2, 2), np.float64)), TypeError, "v_descale"),
    (dict(q_descale="per tensor"), TypeError, "q_descale"),
    (dict(out_dtype=FLOAT32), ValueError, "out_dtype"),
    (dict(out_dtype=np.int8), ValueError, "out_dtype"),
    (dict(config=object()), ValueError, "config"),
    (dict(splits=2), ValueError, "splits"),
    (dict(sinks=(8,)), ValueError, "sinks"),
    (dict(alibi_slopes=(8,)), ValueError, "alibi_slopes"),
])
def test_bad_e4m3_arguments(kwargs, error, name):
    with pytest.raises(error, match=name):
        accounting.memory_report((2, 8, 64, 128), (2, 2, 64, 128), dtype=E4, **kwargs)


def test_bad_inputs_name_themselves():
    q8, k16 = np.zeros((1, 2, 8, 64), E4M3), np.zeros((1, 2, 8, 64), BFLOAT16)
    with pytest.raises(TypeError, match="k: dtype bfloat16"):
        accounting.memory_report(q8, k16, k16)
    with pytest.raises(TypeError, match="v: dtype bfloat16"):
        accounting.memory_report(q8, q8, k16)
    with pytest.raises(TypeError, match="q: dtype uint8"):  # bits without dtype or a descale
        accounting.memory_report(*(np.zeros((1, 2, 8, 64), np.uint8),) * 3)
    with pytest.raises(TypeError, match="q_descale"):
        accounting.memory_report(k16, k16, k16, q_descale=())
    with pytest.raises(ValueError, match="window"):
        accounting.memory_report(k16, k16, k16, window=(4, 4))
    with pytest.raises(ValueError, match="v: head dim 32"):
        accounting.memory_report((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 8, 32), dtype=E4)
    with pytest.raises(ValueError, match="q_descale"):  # packed: one factor per tensor
        accounting.memory_report((10, 2, 64), (10, 2, 64), dtype=E4, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=[0, 5, 10],
                                 q_descale=(2,))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        accounting.memory_report((10, 2, 64), (10, 2, 64), dtype=E4, cu_seqlens_q=[0, 4, 10])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        accounting.memory_report((10, 2, 64), (10, 2, 64), dtype=E4, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=[0, 5, 10],
                                 method="reference")
    with pytest.raises(ValueError, match="out_dtype"):
        accounting.memory_report((1, 2, 8, 64), (1, 2, 8, 64), dtype=E4, method="reference", out_dtype=FLOAT16)
    with pytest.raises(ValueError, match="head dim"):
        accounting.memory_report((1, 2, 8, 320), (1, 2, 8, 320), dtype=E4)


# --------------------------------------------------------------------------- traffic


def tile_loads(causal, nq, nk, bm, bn):
    """(K keys, vt keys) loaded over one head's query tiles: a tile loads the key tiles up to its
    last row's last visible key (row i sees j <= i + nk - nq bottom-right, j <= i top-left); each
    key tile's vt in whole 128-key boxes from its first key, nothing past vt's keys (nk rounded up
    to 32)."""
    causal = masks.normalize_causal(causal)
    k_keys = vt_keys = 0
    vt_end = up(nk, 32)
    for m0 in range(0, nq, bm):
        last_row = min(nq, m0 + bm) - 1
        end = nk if causal is None else max(0, min(nk, last_row + 1 + (nk - nq if causal == "bottom_right" else 0)))
        loaded = up(end, bn)
        k_keys += min(nk, loaded)
        for key0 in range(0, loaded, bn):
            vt_keys += min(vt_end, key0 + up(bn, 128)) - min(vt_end, key0)
    return k_keys, vt_keys


@pytest.mark.parametrize("shape, nk, hkv", [((2, 8, 1000, 128), None, 4), ((1, 4, 300, 64), 1000, 1),
                                             ((2, 2, 777, 256), 333, 2), ((1, 3, 200, 72), 250, 3),
                                             ((1, 2, 130, 100), 129, 1)])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("out_dtype", [None, FLOAT16])
def test_io_model_counts_the_e4m3_forward(shape, nk, hkv, causal, out_dtype):
    b, hq, nq, d = shape
    nk = nq if nk is None else nk
    m = accounting.io_model(shape, dtype=E4, nk=nk, hkv=hkv, causal=causal, out_dtype=out_dtype)
    _, t = plan_hopper.fp8_forward_spec(out_dtype or BFLOAT16, d, causal is not False)
    assert (m.block_m, m.block_n) == (t.block_m, t.block_n)
    k_keys, vt_keys = tile_loads(causal, nq, nk, t.block_m, t.block_n)
    w = up(d, 16)  # q and k as the kernel reads them (copies where d % 16 != 0)
    osz = 2
    want_read = (b * hq * nq * w + b * hq * k_keys * w  # Q, K through their tiles
                 + b * hkv * nk * d + b * hq * vt_keys * d)  # V read by the vt build, vt by the kernel
    want_write = b * hkv * d * up(nk, 32) + b * hq * nq * d * osz + 4 * b * hq * nq  # vt, O, LSE
    if d % 16:  # the copies: read q, k; zero d16 columns, write d
        want_read += b * hq * nq * d + b * hkv * nk * d
        want_write += b * hq * nq * (w + d) + b * hkv * nk * (w + d)
    if d % 8:  # the O scratch: zeroed and written at d8 columns, d columns read back
        want_read += b * hq * nq * d * osz
        want_write += 2 * b * hq * nq * up(d, 8) * osz
    assert (m.read_bytes, m.write_bytes) == (want_read, want_write)
    assert m.compulsory_bytes == b * hq * nq * d + 2 * b * hkv * nk * d + b * hq * nq * d * osz + 4 * b * hq * nq
    assert m.dtype == E4


def test_io_model_e4m3_errors_and_the_cache_path_unchanged():
    with pytest.raises(ValueError, match="out_dtype"):
        accounting.io_model((1, 2, 64, 128), dtype=E4, out_dtype=FLOAT32)
    with pytest.raises(ValueError, match="out_dtype"):
        accounting.io_model((1, 2, 64, 128), dtype="bfloat16", out_dtype=FLOAT16)
    with pytest.raises(ValueError, match="kv_dtype"):
        accounting.io_model((1, 2, 64, 128), dtype=E4, kv_dtype=E4)
    with pytest.raises(ValueError, match="config"):
        accounting.io_model((1, 2, 64, 128), dtype=E4, config=object())
    # a 16-bit q over an e4m3 cache: K and V at one byte, the rest in q's dtype
    cache = accounting.io_model((8, 32, 1, 128), dtype="bfloat16", nk=16384, hkv=8, kv_dtype=E4)
    e = {x.name: x for x in cache.entries}
    assert e["K"].itemsize == 1 and e["Q"].itemsize == 2 and cache.dtype == "bfloat16"
