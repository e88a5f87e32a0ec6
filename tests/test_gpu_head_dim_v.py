"""v's head dim unlike q's and k's on the GPU. The forward's dv kernel (attn_fwd_wgmma_tma_dv) takes
the (d, dv) pairs of plan.schedule.HOPPER_FORWARD_DV_TILES on Hopper (no mask or a causal one);
everything else - the backward, windows, score modifiers, packed sequences, decode shapes, other
pairs and GPUs, float32 - zero-pads the narrower side to the wider (cuflash.backends.cuda._one_width).
Forward and backward of every family, outputs poisoned, fresh random inputs, against the float64
reference by the accuracy rule."""

import dataclasses

import numpy as np
import pytest
from _head_dim_v_cases import check_forward, check_forward_backward, matrix, poisoned, shapes, to_xp

import cuflash
from cuflash.backends import cuda
from cuflash.core import problem as _problem
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.layout import to_bhsd
from cuflash.plan import schedule
from cuflash.testing import assert_forward_accurate, random_array, to_numpy

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DV_PAIRS = sorted(schedule.HOPPER_FORWARD_DV_TILES)  # (192, 128), (128, 64): the dv kernel's
DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]


@matrix
def test_forward_and_backward(rng, dtype, causal, layout, d, dv):
    check_forward_backward(rng, cupy, dtype, layout, causal, d, dv)


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)])
def test_long_rows_and_window(rng, d, dv):
    # enough rows for the Hopper kernels' tiles, and the band kernel with a window
    check_forward_backward(rng, cupy, BFLOAT16, "bhsd", True, d, dv, nq=600, nk=700)
    check_forward_backward(rng, cupy, BFLOAT16, "bshd", True, d, dv, window=(100, -1), nq=300, nk=300)


@pytest.fixture
def hopper_with_tma(monkeypatch):
    from cuflash.kernels import tma

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("not a Hopper GPU: the dv kernel needs sm_90")
    if not tma.available():
        pytest.skip("cuda-bindings is not installed: tensor maps cannot be encoded")
    monkeypatch.setenv("CUFLASH_KERNELS", "auto")


@pytest.fixture
def launched(monkeypatch):
    """The kinds of the wgmma forward plans launched (cuflash.kernels.hopper.launch, spied on)."""
    kinds = []
    real = cuda.hopper.launch

    def spy(plan, *args, **kwargs):
        kinds.append(plan.kernel)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(cuda.hopper, "launch", spy)
    return kinds


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_the_dv_kernel(rng, hopper_with_tma, launched, d, dv, dtype, causal, layout):
    # GQA (4 query heads per K/V head), lengths off every tile, more keys than rows and fewer
    # (bottom-right: the first rows see no key)
    for nq, nk in ((333, 517), (200, 70)):
        launched.clear()
        check_forward(rng, cupy, dtype, layout, causal, d, dv, hq=8, hkv=2, nq=nq, nk=nk)
        assert launched == ["wgmma_dv"], (nq, nk)


@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_the_dv_kernel_then_the_padded_backward(rng, hopper_with_tma, launched, d, dv):
    check_forward_backward(rng, cupy, BFLOAT16, "bhsd", True, d, dv, hq=6, hkv=2, nq=257, nk=389)
    assert launched == ["wgmma_dv"]  # (the backward's kernels are not this module's launch)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_the_twin_tile(rng, hopper_with_tma, launched, d, dv, dtype, causal):
    # the table tile's ping-pong / own-pace twin (compiled in CI for the GPU's measurement), forced
    t = schedule.HOPPER_FORWARD_DV_TILES[(d, dv)]
    tile = dataclasses.replace(t, pingpong=not t.pingpong, reason="test")
    sq, sk, sv = shapes("bhsd", 3, 4, 1, 300, 411, d, dv)
    q, k, v = (random_array(rng, s, dtype) for s in (sq, sk, sv))
    qx, kx, vx = (to_xp(cupy, a) for a in (q, k, v))
    p = _problem.validate_forward(qx, kx, vx, causal=causal)
    o = poisoned(cupy, p.o_shape(), dtype)
    lse = poisoned(cupy, p.lse_shape(), FLOAT32)
    cuda.forward_wgmma(p, to_bhsd(qx, p, p.hq, p.nq), to_bhsd(kx, p, p.hkv, p.nk), to_bhsd(vx, p, p.hkv, p.nk, p.dv),
                       to_bhsd(o, p, p.hq, p.nq, p.dv), lse.reshape((p.batch, p.hq, p.nq)), tile=tile)
    assert launched == ["wgmma_dv"]
    assert_forward_accurate(to_numpy(o), to_numpy(lse), q, k, v, causal=causal)


@pytest.mark.parametrize("d,dv", DV_PAIRS)
def test_what_the_dv_kernel_does_not_take_is_padded(rng, hopper_with_tma, launched, d, dv):
    # a decode shape (split-KV decode at max(d, dv)), a window and a softcap: never the dv kernel
    check_forward(rng, cupy, BFLOAT16, "bhsd", True, d, dv, hq=8, hkv=2, nq=3, nk=700)
    check_forward(rng, cupy, BFLOAT16, "bhsd", True, d, dv, nq=200, nk=200, window=(50, 0))
    check_forward(rng, cupy, BFLOAT16, "bhsd", False, d, dv, nq=200, nk=200, softcap=8.0)
    assert "wgmma_dv" not in launched
    # a misaligned o (rows TMA and 16-byte stores cannot address): padded, still exact
    sq, sk, sv = shapes("bhsd", 1, 2, 2, 150, 160, d, dv)
    q, k, v = (random_array(rng, s, BFLOAT16) for s in (sq, sk, sv))
    qx, kx, vx = (to_xp(cupy, a) for a in (q, k, v))
    raw = poisoned(cupy, (1, 2, 150, dv + 4), BFLOAT16)
    out = raw[..., :dv]
    o = cuflash.attention(qx, kx, vx, causal=True, out=out)
    assert o is out and launched.count("wgmma_dv") == 0
    assert_forward_accurate(to_numpy(o), None, q, k, v, causal=True)
    assert np.all(np.isnan(to_numpy(raw[..., dv:]).astype(np.float32)))  # the columns past o untouched
