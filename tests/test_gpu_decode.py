"""Split-KV decode kernel vs the float64 reference, one sequence at a time (naive-error rule)."""

import numpy as np
import pytest

import cuflash
from cuflash import gpu_decode
from cuflash._arrays import BFLOAT16, FLOAT16
from cuflash._layout import to_bhsd
from cuflash._problem import validate_forward
from cuflash.testing import random_inputs

from _kvlens_check import check_per_sequence

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
    used_decode = gpu_decode.applies(p, to_bhsd(kg, p, hkv, nk), to_bhsd(vg, p, hkv, nk))
    o = cupy.full(qg.shape, np.nan, dtype=np.float32).astype(qg.dtype) if dtype == FLOAT16 else None
    o, lse = cuflash.attention(qg, kg, vg, causal=causal, kv_lens=lg, return_lse=True, out=o)
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
    o4 = cupy.empty(qg.shape, dtype=qg.dtype)
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    gpu_decode.forward(p, qg, kg, vg, o4, lse3, splits=splits)
    check_per_sequence(o4, lse3, q, k, v, [nk] * b, True, BFLOAT16)


def test_decode_no_lens_matches_prefill_path_rule():
    rng = np.random.default_rng(7)
    q, k, v = random_inputs(rng, (8, 32, 1, 128), (8, 8, 4096, 128), BFLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    o, lse = cuflash.attention(qg, kg, vg, causal=True, return_lse=True)
    check_per_sequence(o, lse, q, k, v, [4096] * 8, True, BFLOAT16)
