"""kv_lens on the NumPy backend (the specification the decode kernel is tested against) and its validation."""

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.testing import random_inputs

from _kvlens_check import check_per_sequence


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16, FLOAT32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("nq", [1, 2, 7])
def test_kv_lens_cpu(dtype, causal, nq):
    rng = np.random.default_rng([nq, len(str(causal)), dtype.itemsize])
    b, hq, hkv, nk, d = 4, 4, 2, 300, 64
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    lens = np.array([0, 1, 137, 300], dtype=np.int32)
    before = [a.copy() for a in (q, k, v, lens)]
    o = np.full(q.shape, np.nan, dtype=dtype)
    o, lse = cuflash.attention(q, k, v, causal=causal, kv_lens=lens, return_lse=True, out=o)
    for a, a0 in zip((q, k, v, lens), before):
        assert np.array_equal(a.view(np.uint8), a0.view(np.uint8))
    assert np.all(o[0].astype(np.float32) == 0) and np.all(lse[0] == -np.inf)  # an empty cache
    check_per_sequence(o, lse, q, k, v, lens, causal, dtype)


def test_kv_lens_keys_beyond_are_ignored():
    rng = np.random.default_rng(1)
    q, k, v = random_inputs(rng, (2, 2, 3, 32), (2, 2, 50, 32), np.float32)
    lens = np.array([20, 50], dtype=np.int32)
    o1 = cuflash.attention(q, k, v, kv_lens=lens)
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 20:] = 1e4  # garbage past the valid length must not matter
    v2[0, :, 20:] = np.nan
    o2 = cuflash.attention(q, k2, v2, kv_lens=lens)
    assert np.array_equal(o1, o2)


@pytest.mark.parametrize(
    "lens,exc,msg",
    [
        (np.array([1, 2], dtype=np.int64), TypeError, "int32"),
        (np.array([1, 2, 3], dtype=np.int32), ValueError, "shape"),
        (np.array([1, 51], dtype=np.int32), ValueError, "Nk=50"),
        (np.array([-1, 2], dtype=np.int32), ValueError, "kv_lens"),
        ([1, 2], TypeError, "kv_lens"),
    ],
)
def test_kv_lens_validation(lens, exc, msg):
    rng = np.random.default_rng(2)
    q, k, v = random_inputs(rng, (2, 2, 3, 32), (2, 2, 50, 32), np.float32)
    with pytest.raises(exc, match=msg):
        cuflash.attention(q, k, v, kv_lens=lens)
