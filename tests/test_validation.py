"""Bad inputs: every one raises the right exception type with a message that names the argument.

Runs on NumPy arrays (the CPU backend); the validation is shared with the CUDA backend and the
reference (cuflash.core.problem), and both public entry points and the reference are checked.
"""

import re

import numpy as np
import pytest

import cuflash
from cuflash.backends import reference
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import random_array, random_inputs


def names_argument(name):
    """Regex: the message starts with the argument's name (alone or in a list like 'k, v:')."""
    return rf"^(\w+, )*{re.escape(name)}[:,]"


def inputs(seed, shape_q=(2, 4, 6, 8), shape_kv=(2, 2, 5, 8), dtype=np.float16):
    return random_inputs(np.random.default_rng(seed), shape_q, shape_kv, dtype)


FORWARDS = [
    pytest.param(cuflash.attention, id="attention"),
    pytest.param(reference.attention, id="reference"),
]


def forward_and_grads(seed, dtype=np.float16, shape_q=(2, 4, 6, 8), shape_kv=(2, 2, 5, 8)):
    q, k, v = inputs(seed, shape_q, shape_kv, dtype)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    do = random_array(np.random.default_rng(seed + 1), q.shape, dtype)
    return do, q, k, v, o, lse


# ----------------------------------------------------------------------------- forward: shapes

@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize(
    "shape_q, shape_kv, name",
    [
        ((8,), (5, 8), "q"),  # 1-D query
        ((6, 8), (1, 5, 8), "k"),  # k has more dims than q
        ((2, 4, 6, 8), (2, 5, 8), "k"),  # k has fewer dims than q
        ((2, 4, 6, 8), (3, 2, 5, 8), "k"),  # batch differs
        ((2, 4, 6, 8), (2, 2, 5, 16), "k"),  # head dim differs
        ((2, 4, 6, 8), (2, 3, 5, 8), "k"),  # Hq = 4 not a multiple of Hkv = 3
        ((2, 3, 6, 8), (2, 2, 5, 8), "k"),  # Hq = 3 not a multiple of Hkv = 2
        ((2, 4, 6, 0), (2, 2, 5, 0), "q"),  # d = 0
    ],
)
def test_bad_shapes(fn, shape_q, shape_kv, name):
    rng = np.random.default_rng(len(shape_q) * 10 + len(shape_kv))
    q = random_array(rng, shape_q, np.float16)
    k = random_array(rng, shape_kv, np.float16)
    v = random_array(rng, shape_kv, np.float16)
    with pytest.raises(ValueError, match=names_argument(name)):
        fn(q, k, v)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize(
    "shape_v",
    [(2, 2, 4, 8), (2, 1, 5, 8), (2, 2, 5, 0), (1, 2, 5, 8)],
    ids=["Nk", "heads", "d0", "batch"],  # (v's head dim may differ from q's: tests/test_head_dim_v.py)
)
def test_v_mismatch(fn, shape_v):
    q, k, _ = inputs(1)
    v = random_array(np.random.default_rng(2), shape_v, np.float16)
    with pytest.raises(ValueError, match=names_argument("v")):
        fn(q, k, v)


@pytest.mark.parametrize("fn", FORWARDS)
def test_bshd_layout_reads_heads_from_axis_minus_2(fn):
    # (B, N, H, d) with H = 3 for q and 2 for k: not a multiple only under the bshd reading.
    rng = np.random.default_rng(3)
    q = random_array(rng, (1, 4, 3, 8), np.float32)
    k = random_array(rng, (1, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=names_argument("k")):
        fn(q, k, k.copy(), layout="bshd")


# ----------------------------------------------------------------------------- forward: dtypes, libraries

@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.int8, np.complex64, bool])
def test_unsupported_dtype(fn, dtype):
    q, k, v = inputs(4, dtype=np.float32)
    with pytest.raises(TypeError, match=names_argument("q")):
        fn(q.astype(dtype), k.astype(dtype), v.astype(dtype))


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("other", [np.float32, BFLOAT16])
def test_mixed_dtypes(fn, which, other):
    q, k, v = inputs(5, dtype=np.float16)
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].astype(other)
    with pytest.raises(TypeError, match=names_argument(which)):
        fn(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [lambda a: a.tolist(), lambda a: 1.0, lambda a: None], ids=["list", "float", "None"])
def test_non_arrays(fn, which, bad):
    q, k, v = inputs(6, dtype=np.float32)
    args = {"q": q, "k": k, "v": v}
    args[which] = bad(args[which])
    with pytest.raises(TypeError, match=names_argument(which)):
        fn(args["q"], args["k"], args["v"])


# ----------------------------------------------------------------------------- forward: options

@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("scale", [0, 0.0, -1.0, -0.125, float("inf"), float("-inf"), float("nan"), np.float32("nan")])
def test_bad_scale_value(fn, scale):
    q, k, v = inputs(7)
    with pytest.raises(ValueError, match=names_argument("scale")):
        fn(q, k, v, scale=scale)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("scale", [True, False, np.bool_(True), "0.5", [0.5], 0.5j])
def test_bad_scale_type(fn, scale):
    q, k, v = inputs(8)
    with pytest.raises(TypeError, match=names_argument("scale")):
        fn(q, k, v, scale=scale)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("layout", ["BHSD", "bsh", "", None, 0])
def test_bad_layout(fn, layout):
    q, k, v = inputs(9)
    with pytest.raises(ValueError, match=names_argument("layout")):
        fn(q, k, v, layout=layout)


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("causal", ["yes", "top-left", "BOTTOM_RIGHT", 1, 2.0, "causal"])
def test_bad_causal(fn, causal):
    q, k, v = inputs(10)
    with pytest.raises(ValueError, match=names_argument("causal")):
        fn(q, k, v, causal=causal)


def test_reference_bad_precision():
    q, k, v = inputs(11)
    with pytest.raises(ValueError, match=names_argument("precision")):
        reference.attention(q, k, v, precision="float16")


# ----------------------------------------------------------------------------- out=

def test_out_wrong_shape():
    q, k, v = inputs(12)
    with pytest.raises(ValueError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=np.empty((2, 4, 6, 9), dtype=q.dtype))
    with pytest.raises(ValueError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=np.empty((2, 6, 4, 8), dtype=q.dtype))


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.float64])
def test_out_wrong_dtype(dtype):
    q, k, v = inputs(13)
    with pytest.raises(TypeError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=np.empty(q.shape, dtype=dtype))


def test_out_not_an_array():
    q, k, v = inputs(14)
    with pytest.raises(TypeError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=np.empty(q.shape, dtype=q.dtype).tolist())


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_out_aliases_input(which):
    # Self-attention shapes so that out= can be an input itself.
    q, k, v = inputs(15, shape_q=(2, 4, 6, 8), shape_kv=(2, 4, 6, 8))
    args = {"q": q, "k": k, "v": v}
    before = {n: a.copy() for n, a in args.items()}
    with pytest.raises(ValueError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=args[which])
    for n, a in args.items():
        assert np.array_equal(a, before[n]), f"{n} was modified"


def test_out_overlaps_part_of_input():
    # out is a view into a buffer that also holds q: partial overlap counts.
    rng = np.random.default_rng(16)
    buf = random_array(rng, (2, 2, 4, 6, 8), np.float32)
    q = buf[0]
    k, v = random_array(rng, (2, 4, 6, 8), np.float32), random_array(rng, (2, 4, 6, 8), np.float32)
    out = buf.reshape(-1)[8: 8 + q.size].reshape(q.shape)
    with pytest.raises(ValueError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=out)


def test_out_read_only():
    q, k, v = inputs(17)
    out = np.empty(q.shape, dtype=q.dtype)
    out.setflags(write=False)
    with pytest.raises(ValueError, match=names_argument("out")):
        cuflash.attention(q, k, v, out=out)


# ----------------------------------------------------------------------------- backward

BACKWARDS = [
    pytest.param(cuflash.attention_backward, id="attention_backward"),
    pytest.param(reference.attention_backward, id="reference"),
]


@pytest.mark.parametrize("fn", BACKWARDS)
@pytest.mark.parametrize("which", ["do", "o"])
@pytest.mark.parametrize("shape", [(2, 4, 6, 7), (2, 4, 5, 8), (4, 6, 8), (2, 2, 6, 8)])
def test_backward_do_o_wrong_shape(fn, which, shape):
    args = dict(zip(("do", "q", "k", "v", "o", "lse"), forward_and_grads(20)))
    args[which] = random_array(np.random.default_rng(21), shape, np.float16)
    with pytest.raises(ValueError, match=names_argument(which)):
        fn(*args.values())


@pytest.mark.parametrize("fn", BACKWARDS)
@pytest.mark.parametrize("which", ["do", "o"])
def test_backward_do_o_wrong_dtype(fn, which):
    args = dict(zip(("do", "q", "k", "v", "o", "lse"), forward_and_grads(22)))
    args[which] = args[which].astype(np.float32)
    with pytest.raises(TypeError, match=names_argument(which)):
        fn(*args.values())


@pytest.mark.parametrize("fn", BACKWARDS)
@pytest.mark.parametrize("which", ["do", "o", "lse"])
def test_backward_non_array(fn, which):
    args = dict(zip(("do", "q", "k", "v", "o", "lse"), forward_and_grads(23)))
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=names_argument(which)):
        fn(*args.values())


@pytest.mark.parametrize("fn", BACKWARDS)
@pytest.mark.parametrize("shape", [(2, 4, 5), (2, 4, 6, 1), (4, 6), (2, 2, 6), (2, 4, 6, 8)])
def test_backward_lse_wrong_shape(fn, shape):
    do, q, k, v, o, _ = forward_and_grads(24)
    lse = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match=names_argument("lse")):
        fn(do, q, k, v, o, lse)


@pytest.mark.parametrize("fn", BACKWARDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64, BFLOAT16, np.int32])
def test_backward_lse_wrong_dtype(fn, dtype):
    do, q, k, v, o, lse = forward_and_grads(25)
    with pytest.raises(TypeError, match=names_argument("lse")):
        fn(do, q, k, v, o, lse.astype(dtype))


@pytest.mark.parametrize("fn", BACKWARDS)
def test_backward_shares_forward_checks(fn):
    do, q, k, v, o, lse = forward_and_grads(26)
    with pytest.raises(ValueError, match=names_argument("scale")):
        fn(do, q, k, v, o, lse, scale=-1.0)
    with pytest.raises(ValueError, match=names_argument("causal")):
        fn(do, q, k, v, o, lse, causal="diagonal")
    with pytest.raises(ValueError, match=names_argument("layout")):
        fn(do, q, k, v, o, lse, layout="sbhd")
    with pytest.raises(TypeError, match=names_argument("k")):
        fn(do, q, k.astype(np.float32), v, o, lse)


@pytest.mark.parametrize("deterministic", [1, 0, "yes", None, 1.0])
def test_backward_deterministic_must_be_bool(deterministic):
    do, q, k, v, o, lse = forward_and_grads(27)
    with pytest.raises(TypeError, match=names_argument("deterministic")):
        cuflash.attention_backward(do, q, k, v, o, lse, deterministic=deterministic)


def test_backward_deterministic_numpy_bool_accepted():
    do, q, k, v, o, lse = forward_and_grads(28)
    a = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=np.bool_(True))
    b = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=False)
    for x, y in zip(a, b):  # the CPU is always deterministic: both flags give the same bits
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("flag", ["return_lse", "validate"])
@pytest.mark.parametrize("value", [1, 0, "yes", "no", None, 1.0])
def test_forward_flags_must_be_bool(flag, value):
    # A truthy non-bool (return_lse="no") must not quietly change what comes back.
    rng = np.random.default_rng(30)
    q, k, v = random_inputs(rng, (2, 6, 8), (2, 5, 8), np.float16)
    with pytest.raises(TypeError, match=names_argument(flag)):
        cuflash.attention(q, k, v, **{flag: value})
    with pytest.raises(TypeError, match=names_argument("return_lse")):
        cuflash.backends.reference.attention(q, k, v, return_lse=value)
    o, lse = cuflash.attention(q, k, v, **{flag: np.bool_(True)}, **({} if flag == "return_lse" else {"return_lse": True}))
    assert o.shape == q.shape and lse.shape == (2, 6)


def test_backward_out_must_be_three_arrays():
    do, q, k, v, o, lse = forward_and_grads(32)
    for out, says in (((np.empty_like(q),), "a tuple of 1"), ((None, None, None), "with None in it")):
        with pytest.raises(TypeError, match=names_argument("out")) as info:
            cuflash.attention_backward(do, q, k, v, o, lse, out=out)
        assert says in str(info.value)


def test_numpy_scalar_inputs_name_the_argument():
    # A NumPy scalar is a NumPy object, not a foreign array: the error names q and its kind.
    rng = np.random.default_rng(31)
    _, k, v = random_inputs(rng, (2, 6, 8), (2, 5, 8), np.float16)
    with pytest.raises(TypeError, match=names_argument("q")):
        cuflash.attention(np.float16(1), k, v)


def test_2d_lse_shape():
    # One head given as (N, d): lse is (N,), and a (1, N) lse is rejected.
    rng = np.random.default_rng(29)
    q, k, v = random_inputs(rng, (6, 8), (5, 8), np.float32)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    assert lse.shape == (6,)
    do = random_array(rng, q.shape, np.float32)
    with pytest.raises(ValueError, match=names_argument("lse")):
        cuflash.attention_backward(do, q, k, v, o, lse.reshape(1, 6))


# ----------------------------------------------------------------------------- inputs unchanged

@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_inputs_never_modified(dtype, causal):
    do, q, k, v, o, lse = forward_and_grads(30, dtype=dtype)
    args = (do, q, k, v, o, lse)
    before = [a.copy() for a in args]
    cuflash.attention(q, k, v, causal=causal, return_lse=True)
    reference.attention(q, k, v, causal=causal, return_lse=True)
    cuflash.attention_backward(*args, causal=causal)
    reference.attention_backward(*args, causal=causal, precision="float64")
    for name, a, b in zip(("do", "q", "k", "v", "o", "lse"), args, before):
        assert a.tobytes() == b.tobytes(), f"{name} was modified"
