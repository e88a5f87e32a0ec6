"""cuflash.merge_attention_states and attention(out_dtype=float32) on the NumPy backend: merged
partial results over disjoint key slices against the float64 reference of the whole problem (the
accuracy rule), rows no part saw, the in-place form, validation; and the backward of a key slice
with the global o and lse (what context parallelism needs) for every dtype."""

import numpy as np
import pytest
from _merge_cases import check_merge_equals_full, check_slice_backward, partials

import cuflash
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import random_array, random_inputs, reference64

DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(np.float32, id="f32")]


def shapes(layout, b, hq, hkv, nq, nk, d):
    if layout == "bhsd":
        return (b, hq, nq, d), (b, hkv, nk, d)
    return (b, nq, hq, d), (b, nk, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cuts", [(0, 70), (0, 31, 70), (0, 5, 40, 64, 70)], ids=["1part", "2parts", "4parts"])
def test_merge_of_key_slices_equals_full_attention(rng, dtype, layout, causal, cuts):
    # GQA (4 query heads on 2 K/V heads); Nq > Nk so that causal rows 0..9 see no key at all, and
    # every slice but the first has rows that see none of its keys.
    sq, skv = shapes(layout, 2, 4, 2, 80, 70, 24)
    q, k, v = random_inputs(rng, sq, skv, dtype)
    o, lse = check_merge_equals_full(q, k, v, list(cuts), causal=causal, layout=layout)
    if causal:
        assert np.all(lse[..., :10] == -np.inf) and not np.isnan(o.astype(np.float32)).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_single_head_2d(rng, dtype):
    q, k, v = random_inputs(rng, (37, 16), (90, 16), dtype)
    check_merge_equals_full(q, k, v, [0, 45, 90], causal=True, layout="bhsd")


def test_out_dtype_float32_stores_the_accumulator(rng):
    for dtype in (np.float16, BFLOAT16):
        q, k, v = random_inputs(rng, (2, 3, 40, 32), (2, 3, 50, 32), dtype)
        o16, lse16 = cuflash.attention(q, k, v, causal=True, return_lse=True)
        o32, lse32 = cuflash.attention(q, k, v, causal=True, return_lse=True, out_dtype=np.float32)
        assert o32.dtype == np.float32 and lse32.dtype == np.float32
        # the same arithmetic, rounded once to 16 bits or not at all
        assert np.array_equal(o32.astype(dtype), o16) and np.array_equal(lse32, lse16)
        assert np.any(o32 != o32.astype(dtype).astype(np.float32))
        ref, _ = reference64(q, k, v, causal=True)
        assert np.abs(o32 - ref).max() < np.abs(o16.astype(np.float64) - ref).max()
    # float32 inputs: out_dtype=float32 is the default
    q, k, v = random_inputs(rng, (1, 2, 9, 8), (1, 2, 9, 8), np.float32)
    assert np.array_equal(cuflash.attention(q, k, v, out_dtype=np.float32), cuflash.attention(q, k, v))


def test_out_dtype_on_every_forward_path(rng):
    q, k, v = random_inputs(rng, (2, 2, 3, 16), (2, 2, 40, 16), BFLOAT16)
    lens = np.array([40, 17], dtype=np.int32)
    o = cuflash.attention(q, k, v, kv_lens=lens, out_dtype=np.float32)
    ref = cuflash.attention(q, k, v, kv_lens=lens)
    assert o.dtype == np.float32 and np.array_equal(o.astype(BFLOAT16), ref)
    # packed sequences
    qp, kp, vp = random_inputs(rng, (12, 2, 16), (30, 2, 16), BFLOAT16)
    cq, ck = np.array([0, 5, 12], dtype=np.int32), np.array([0, 10, 30], dtype=np.int32)
    o = cuflash.attention(qp, kp, vp, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, out_dtype=np.float32)
    ref = cuflash.attention(qp, kp, vp, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    assert o.dtype == np.float32 and np.array_equal(o.astype(BFLOAT16), ref)
    # paged cache
    kc, vc = (random_array(rng, (6, 16, 2, 16), BFLOAT16) for _ in range(2))
    table = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32)
    o = cuflash.attention(q, kc, vc, block_table=table, kv_lens=np.array([48, 20], dtype=np.int32),
                          out_dtype=np.float32)
    assert o.dtype == np.float32
    # out= must then be float32
    out = np.full(q.shape, np.nan, dtype=np.float32)
    assert cuflash.attention(q, k, v, out=out, out_dtype=np.float32) is out and np.isfinite(out).all()
    with pytest.raises(TypeError, match="out: expected dtype float32"):
        cuflash.attention(q, k, v, out=np.empty(q.shape, BFLOAT16), out_dtype=np.float32)
    for bad in (np.float16, np.float64, "nope"):
        with pytest.raises(TypeError, match="out_dtype"):
            cuflash.attention(q, k, v, out_dtype=bad)


def test_rows_no_part_saw_are_zero_and_nan_free(rng):
    o = random_array(rng, (3, 2, 4, 5, 8), np.float32)
    lse = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    lse[:, 0, 1, 2] = -np.inf  # no part saw row (0, 1, 2)
    o[:, 0, 1, 2] = np.nan  # whatever a part holds there does not count
    lse[1, 1, 3, 4] = -np.inf  # part 1 saw nothing of row (1, 3, 4): its NaN must not leak
    o[1, 1, 3, 4] = np.nan
    m, ml = cuflash.merge_attention_states(o, lse)
    assert np.all(m[0, 1, 2] == 0) and ml[0, 1, 2] == -np.inf
    assert np.isfinite(m).all() and np.isfinite(ml[1, 3, 4])
    w = np.exp(lse[[0, 2], 1, 3, 4].astype(np.float64))
    want = (w[:, None] * o[[0, 2], 1, 3, 4]).sum(axis=0) / w.sum()
    np.testing.assert_allclose(m[1, 3, 4], want, rtol=1e-6)
    np.testing.assert_allclose(ml[1, 3, 4], np.log(w.sum()), rtol=1e-6)


def test_one_part_is_the_identity_and_inputs_are_untouched(rng):
    o = random_array(rng, (1, 2, 3, 7, 16), BFLOAT16)
    lse = rng.standard_normal((1, 2, 3, 7)).astype(np.float32)
    before = (o.copy(), lse.copy())
    m, ml = cuflash.merge_attention_states(o, lse)
    assert m.dtype == BFLOAT16 and np.array_equal(m, o[0]) and np.array_equal(ml, lse[0])
    assert np.array_equal(o, before[0]) and np.array_equal(lse, before[1])


def test_in_place_form_and_strided_outputs(rng):
    parts = [cuflash.attention(*random_inputs(rng, (2, 6, 3, 8), (2, 9, 3, 8), np.float16), layout="bshd",
                               return_lse=True, out_dtype=np.float32) for _ in range(3)]
    o_parts, lse_parts = [p[0] for p in parts], [p[1] for p in parts]
    want_o, want_lse = cuflash.merge_attention_states(o_parts, lse_parts, layout="bshd", dtype=np.float16)
    big = np.full((2, 6, 3, 16), np.nan, dtype=np.float16)
    out = big[..., ::2]  # strided head dim: written through a scratch array
    lse_out = np.full((2, 3, 6), np.nan, dtype=np.float32)
    ro, rl = cuflash.merge_attention_states(o_parts, lse_parts, layout="bshd", dtype=np.float16, out=out,
                                            lse_out=lse_out)
    assert ro is out and rl is lse_out
    assert np.array_equal(out, want_o) and np.array_equal(lse_out, want_lse) and np.isnan(big[..., 1::2]).all()


def test_validation_names_the_argument(rng):
    o = random_array(rng, (2, 1, 3, 5, 8), np.float32)
    lse = np.zeros((2, 1, 3, 5), dtype=np.float32)
    m = cuflash.merge_attention_states
    cases = [
        (TypeError, "lse_parts: expected dtype float32", lambda: m(o, lse.astype(np.float64))),
        (ValueError, "lse_parts: expected shape", lambda: m(o, lse[:, :, :, :4])),
        (ValueError, "lse_parts: expected shape", lambda: m(o, lse, layout="bshd")),
        (TypeError, "o_parts: dtype float64", lambda: m(o.astype(np.float64), lse)),
        (ValueError, "o_parts: expected a leading parts axis", lambda: m(o[0, 0, 0], lse[0, 0])),
        (ValueError, "o_parts: expected at least one part", lambda: m(o[:0], lse[:0])),
        (ValueError, "o_parts: expected at least one part", lambda: m([], [])),
        (ValueError, "o_parts: the parts have different shapes", lambda: m([o[0], o[1, :, :2]], [lse[0], lse[1]])),
        (TypeError, "o_parts: the parts have different dtypes", lambda: m([o[0], o[1].astype(np.float16)], list(lse))),
        (TypeError, r"o_parts\[0\]: expected a numpy.ndarray", lambda: m(o.tolist(), lse)),
        (TypeError, "o_parts: expected an array", lambda: m("o", lse)),
        (ValueError, "layout", lambda: m(o, lse, layout="sbhd")),
        (TypeError, "dtype: float64", lambda: m(o, lse, dtype=np.float64)),
        (ValueError, "out: expected shape", lambda: m(o, lse, out=np.empty((1, 3, 5, 7), np.float32))),
        (TypeError, "out: expected dtype bfloat16", lambda: m(o, lse, dtype=BFLOAT16, out=np.empty(o.shape[1:], np.float32))),
        (ValueError, "out: must not overlap input o_parts", lambda: m(o, lse, out=o[0])),
        (ValueError, "lse_out: must not overlap input lse_parts", lambda: m(o, lse, lse_out=lse[1])),
        (TypeError, "lse_out: expected dtype float32", lambda: m(o, lse, lse_out=np.empty(lse.shape[1:], np.float64))),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    both = np.empty(40, dtype=np.float32)
    with pytest.raises(ValueError, match="lse_out: must not overlap out"):
        m(o[:, 0, 0, :1, :8].reshape(2, 1, 8)[:, :, :], lse[:, 0, 0, :1], out=both[:8].reshape(1, 8),
          lse_out=both[:1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_of_a_key_slice_with_the_global_o_and_lse(rng, dtype, layout, causal):
    # GQA; Nq > Nk (causal rows that see no key); slices of uneven lengths.
    sq, skv = shapes(layout, 2, 4, 2, 50, 45, 16)
    q, k, v = random_inputs(rng, sq, skv, dtype)
    do = random_array(rng, sq, dtype)
    check_slice_backward(do, q, k, v, [0, 12, 30, 45], causal=causal, layout=layout)


def test_float32_backward_of_the_whole_key_set_still_refines_lse(rng):
    # The given lse is the forward's (this call's own keys): the float64 refinement applies, so the
    # gradients equal those from the exact lse, bit for bit.
    q, k, v = random_inputs(rng, (1, 2, 30, 16), (1, 2, 30, 16), np.float32, 4.0)
    do = random_array(rng, q.shape, np.float32)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    _, lse64 = reference64(q, k, v)
    shifted = np.nextafter(lse, np.float32(np.inf))  # one ulp off: still taken as this call's own
    g1 = cuflash.attention_backward(do, q, k, v, o, lse)
    g2 = cuflash.attention_backward(do, q, k, v, o, shifted)
    for a, b in zip(g1, g2):
        assert np.array_equal(a, b)
    assert np.abs(lse.astype(np.float64) - lse64).max() > 0  # the float32 lse was rounded


def test_partials_helper_masks(rng):
    # the slice masks reproduce the whole problem's visibility: every key of a causal problem is
    # seen by exactly the rows the reference lets see it (lse of merged = lse of full, checked above);
    # here: a slice no query sees gives lse = -inf everywhere
    q, k, v = random_inputs(rng, (1, 1, 4, 8), (1, 1, 20, 8), np.float32)
    (o, lse), = partials(q[:, :, :1], k, v, [0, 20], causal=True, layout="bhsd")
    assert np.isfinite(lse).all()


def test_memory_report_models_out_dtype_float32():
    # d a multiple of 8: the mma.sync kernel's float32 epilogue, no copies
    r = cuflash.memory_report((2, 8, 1024, 128), (2, 2, 4096, 128), dtype=BFLOAT16, out_dtype=np.float32)
    base = cuflash.memory_report((2, 8, 1024, 128), (2, 2, 4096, 128), dtype=BFLOAT16)
    byname = {e.name: e for e in r.entries}
    assert byname["O"].bytes == 2 * 8 * 1024 * 128 * 4 and "attn_fwd_o32" in byname["shared memory / block (fwd)"].note
    assert r.device_bytes == base.device_bytes + 2 * 8 * 1024 * 128 * 2
    # otherwise the inputs are widened
    q, kv = (2, 8, 1024, 100), (2, 2, 4096, 100)
    base = cuflash.memory_report(q, kv, dtype=BFLOAT16)
    wide = cuflash.memory_report(q, kv, dtype=BFLOAT16, out_dtype=np.float32)
    f32 = cuflash.memory_report(q, kv, dtype=np.float32)
    byname = {e.name: e.bytes for e in wide.entries}
    q_bytes, kv_bytes = 2 * 8 * 1024 * 100, 2 * 2 * 4096 * 100
    assert byname["Q"] == 2 * q_bytes and byname["K"] == byname["V"] == 2 * kv_bytes
    assert byname["Q (float32 copy)"] == 4 * q_bytes and byname["K (float32 copy)"] == 4 * kv_bytes
    assert byname["O"] == 4 * q_bytes
    assert wide.device_bytes == f32.device_bytes + 2 * q_bytes + 4 * kv_bytes > base.device_bytes
    assert cuflash.memory_report(q, kv, dtype=np.float32, out_dtype=np.float32) == f32
    with pytest.raises(ValueError, match="out_dtype"):
        cuflash.memory_report(q, kv, dtype=BFLOAT16, out_dtype=np.float32, pass_="bwd")
    with pytest.raises(TypeError, match="out_dtype"):
        cuflash.memory_report(q, kv, dtype=BFLOAT16, out_dtype=np.float16)


def _launch_kinds(monkeypatch, module, call):
    """The launch's (spec, argument kinds) with get_function recording instead of compiling."""
    def _kind(arg):
        if isinstance(arg, np.ndarray) and arg.ndim:
            return "u64"  # a pointer
        return {np.dtype(np.int64): "u64", np.dtype(np.int32): "u32", np.dtype(np.float32): "f32",
                np.dtype(np.float64): "f64"}[np.asarray(arg).dtype]

    calls = []
    monkeypatch.setattr(module, "get_function", lambda spec: lambda grid, block, args, **kw: calls.append((spec, args)))
    call()
    ((spec, args),) = calls
    return spec, [_kind(a) for a in args]


def test_merge_kernel_arguments_match_its_parameters(monkeypatch):
    from test_fp32_backward import _ptx_params

    from cuflash.kernels import merge as merge_kernels

    o5 = np.zeros((3, 2, 4, 5, 8), BFLOAT16)
    spec, kinds = _launch_kinds(monkeypatch, merge_kernels, lambda: merge_kernels.launch(
        o5, np.zeros((3, 2, 4, 5), np.float32), np.zeros((2, 4, 5, 8), np.float32), np.zeros((2, 4, 5), np.float32)))
    assert spec.expression == "merge_states<Bf16, float, float>"
    assert kinds == _ptx_params(spec)


def test_float32_epilogue_kernel_arguments_match_its_parameters(monkeypatch):
    from test_fp32_backward import _ptx_params

    from cuflash.core import problem
    from cuflash.kernels import forward as forward_kernels
    from cuflash.plan import forward as plan_forward
    from cuflash.plan import registry

    q = np.zeros((1, 2, 5, 64), np.float16)
    p = problem.validate_forward(q, q, q, causal=True)
    spec, tile = plan_forward.forward_spec(p.dtype, 64, True, True, o32=True)
    assert spec.expression.startswith("attn_fwd_o32<Fp16, 64,") and spec in registry.all_specs()
    plain, plain_tile = plan_forward.forward_spec(p.dtype, 64, True, True)
    assert (tile, spec.smem_bytes, spec.threads) == (plain_tile, plain.smem_bytes, plain.threads)
    with pytest.raises(ValueError, match="o32"):
        plan_forward.forward_spec(p.dtype, 64, True, False, o32=True)
    _, kinds = _launch_kinds(monkeypatch, forward_kernels, lambda: forward_kernels.launch_forward(
        spec, tile.block_m, p, q, q, q, np.zeros(q.shape, np.float32), np.zeros((1, 2, 5), np.float32)))
    assert kinds == _ptx_params(spec)


def test_out_dtype_with_score_modifiers_on_the_cpu(rng):
    q, k, v = random_inputs(rng, (1, 2, 9, 16), (1, 2, 12, 16), BFLOAT16)
    sinks = np.array([0.5, -1.0], np.float32)
    o32 = cuflash.attention(q, k, v, causal=True, softcap=5.0, sinks=sinks, out_dtype=np.float32)
    o16 = cuflash.attention(q, k, v, causal=True, softcap=5.0, sinks=sinks)
    assert o32.dtype == np.float32 and np.array_equal(o32.astype(BFLOAT16), o16)
