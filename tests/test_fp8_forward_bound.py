"""The e4m3 GPU kernel's accuracy check (tests/_fp8_cases.py), on the CPU with emulated kernels:
P rounded at other points than the check's realizations passes it; the errors it is there to
catch (v's descale dropped, another head's descale read, the scores' descale missing) fail it.
The online softmax's emulation itself: one tile of every key is the row-max arithmetic."""

import numpy as np
import pytest

from cuflash import fp8

from _fp8_cases import assert_fp8_forward, make_case, q_descale_per_q_head

BLOCK_N, STEPS = 128, 4  # the d=128 kernel's tile and its k32 steps of S
SHAPE = dict(b=2, hq=4, hkv=2, nq=150, nk=333, d=128)


def _case(rng, granularity="head", layout="bhsd"):
    return make_case(rng, **SHAPE, granularity=granularity, layout=layout)


def _emulated(case, causal, *, qd=None, kd=None, vd=None, block_n=96):
    """(o, lse) of an emulated kernel rounding P against the running max of ``block_n``-key tiles
    (not one of the check's realizations), with the given descales in place of the case's."""
    qd = q_descale_per_q_head(case) if qd is None else qd
    kd = case["kd"] if kd is None else kd
    vd = case["vd"] if vd is None else vd
    return fp8.emulate_attention(case["q8"], case["k8"], case["v8"], qd, kd, vd, causal=causal,
                                 layout=case["layout"], block_n=block_n)


def _most_different_head(descale):
    """For each (batch, head), the descale of the head of the same batch entry whose descale is the
    furthest from its own (in ratio): what a kernel indexing the wrong head would read."""
    logd = np.log(descale)
    far = np.abs(logd[:, :, None] - logd[:, None, :]).argmax(axis=2)
    return np.take_along_axis(descale, far, axis=1)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_other_rounding_points_pass(rng, granularity, causal, layout):
    case = _case(rng, granularity, layout)
    o, lse = _emulated(case, causal)
    assert_fp8_forward(o, lse, case, causal=causal, block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)
    o, lse = _emulated(case, causal, block_n=48)
    assert_fp8_forward(o, lse, case, causal=causal, block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_a_dropped_v_descale_fails(rng, granularity):
    case = _case(rng, granularity)
    o, lse = _emulated(case, False, vd=np.ones_like(case["vd"]))
    with pytest.raises(AssertionError, match="^o "):
        assert_fp8_forward(o, lse, case, causal=False, block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_another_heads_descale_fails(rng, which, causal):
    case = _case(rng, "head")
    wrong = {which + "d": _most_different_head(q_descale_per_q_head(case) if which == "q" else case[which + "d"])}
    o, lse = _emulated(case, causal, **wrong)
    with pytest.raises(AssertionError, match="^o "):
        assert_fp8_forward(o, None, case, causal=causal, block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)
    if which != "v":  # the scores' scale moves lse too, beyond its own bound
        with pytest.raises(AssertionError, match="^lse: "):
            assert_fp8_forward(o, lse, case, causal=causal, block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype,
                               descales=(wrong.get("qd", q_descale_per_q_head(case)), wrong.get("kd", case["kd"]),
                                         case["vd"]))


def test_a_q_descale_per_kv_head_is_the_groups(rng):
    # FlashAttention-3's q descale per (batch, K/V head): the check expands it to the group's query
    # heads; reading it per query head (index h instead of h // group) fails.
    # (inputs where the misread is visible: the two K/V heads' q descales at least 2^0.5 apart in
    # every batch entry; with near-equal ones reading the other head's changes nothing measurable)
    for _ in range(100):
        case = make_case(rng, **SHAPE, q_per_kv_head=True)
        if np.all(np.abs(np.log2(case["qd"][:, 0] / case["qd"][:, 1])) >= 0.5):
            break
    assert case["qd"].shape == (2, 2) and np.all(np.abs(np.log2(case["qd"][:, 0] / case["qd"][:, 1])) >= 0.5)
    o, lse = _emulated(case, "bottom_right")
    assert_fp8_forward(o, lse, case, causal="bottom_right", block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)
    by_q_head = np.concatenate([case["qd"], case["qd"][:, ::-1]], axis=1)  # q heads 0..3 read entries 0, 1, 1, 0
    o, _ = _emulated(case, "bottom_right", qd=by_q_head)
    with pytest.raises(AssertionError, match="^o "):
        assert_fp8_forward(o, None, case, causal="bottom_right", block_n=BLOCK_N, steps=STEPS, out_dtype=o.dtype)


def test_one_tile_of_every_key_is_the_row_max_arithmetic(rng):
    case = _case(rng, "head")
    args = (case["q8"], case["k8"], case["v8"], case["qd"], case["kd"], case["vd"])
    for causal in (False, "top_left"):
        want = fp8.emulate_attention(*args, causal=causal, out_dtype=np.float32)
        got = fp8.emulate_attention(*args, causal=causal, out_dtype=np.float32, block_n=SHAPE["nk"])
        assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got))
        # several tiles round P elsewhere: o moves, lse (from the unrounded P) stays within float32 noise
        tiled = fp8.emulate_attention(*args, causal=causal, out_dtype=np.float32, block_n=32)
        assert not np.array_equal(tiled[0], want[0])
        np.testing.assert_allclose(tiled[1], want[1], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="block_n"):
        fp8.emulate_attention(*args, block_n=0)
