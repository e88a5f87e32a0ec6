"""MLA decoding on the GPU (attn_decode_mla, plan.decode_mla): the CPU cases of tests/_mla_cases.py
with the split count forced to one and to many (the 512-wide attn_decode_combine), v aliasing k (one
cache read) and v separate, float16 and bfloat16, lse; fresh random inputs, poisoned outputs, the
float64 reference by the accuracy rule."""

import numpy as np
import pytest
from _launches import record_launches
from _mla_cases import CASES, DV, check_mla

from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import decode_mla as mla_kernels
from cuflash.plan import decode_mla

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
SPLITS = [pytest.param(1, id="one_split"), pytest.param(7, id="seven_splits"), pytest.param(None, id="planned")]


@pytest.fixture
def forced_splits(monkeypatch):
    """Force the launcher's split count (None: the planner's)."""
    def force(n):
        plan = decode_mla.launch_plan
        monkeypatch.setattr(decode_mla, "launch_plan", lambda p, sms, splits=None, waves=None: plan(p, sms, n or splits, waves))
    return force


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("v_alias", [pytest.param(True, id="v_in_k"), pytest.param(False, id="v_separate")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(rng, forced_splits, case, dtype, v_alias, splits):
    forced_splits(splits)
    check_mla(rng, cupy, dtype, v_alias=v_alias, **CASES[case])


def test_long_cache_many_splits(rng, forced_splits):
    forced_splits(None)
    check_mla(rng, cupy, BFLOAT16, batch=2, hq=128, hkv=1, nq=1, nk=9000, lens=[9000, 4097])


def test_v_view_is_read_in_place(rng, monkeypatch):
    """v = k[..., :512] launches the V_IN_K instantiation on the caller's memory (no copy of k or v)."""
    seen = record_launches(monkeypatch, mla_kernels)
    check_mla(rng, cupy, BFLOAT16, hq=16, hkv=1, nq=1, nk=2048)
    assert any(e.startswith("attn_decode_mla<") and e.endswith(", true>") for e in seen), seen


def test_v_in_k_detection():
    k = cupy.zeros((1, 1, 64, 576), dtype=np.float16)
    assert mla_kernels.v_in_k(k, k[..., :DV])
    assert not mla_kernels.v_in_k(k, cupy.zeros((1, 1, 64, DV), dtype=np.float16))
    assert not mla_kernels.v_in_k(k, k[..., 64:64 + DV])  # another pointer: not the first 512 columns
