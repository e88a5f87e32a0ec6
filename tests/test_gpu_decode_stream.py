"""The stream decode kernel (attn_decode_stream): all (sequence, K/V head) pairs' keys cut into
equal block ranges that cross pair boundaries, per-warp partials merged by the last writer of a
pair. Checked per sequence against the float64 reference (naive-error rule), outputs poisoned,
each launch run twice (the per-pair counters must be back at zero after a launch)."""

import numpy as np
import pytest

from cuflash import gpu_decode
from cuflash._arrays import BFLOAT16, FLOAT16
from cuflash._problem import validate_forward
from cuflash.testing import random_inputs

from _kvlens_check import check_per_sequence

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("nq", [1, 7, 16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 2, 64), (4, 4, 256), (6, 2, 40)])
@pytest.mark.parametrize("sms", [1, 3, 132])
def test_decode_stream(monkeypatch, dtype, causal, nq, hq, hkv, d, sms):
    # sms: the SM count the plan divides the keys for - 1 or 3 give blocks whose ranges cross
    # pair boundaries mid-way and several waves; 132 gives many blocks per pair.
    monkeypatch.setattr(gpu_decode, "_sm_count", lambda dev: sms)
    rng = np.random.default_rng([nq, hq, hkv, d, sms, len(str(causal)), dtype.itemsize])
    b, nk = 5, 1300
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    p = validate_forward(qg, kg, vg, causal=causal)
    if not gpu_decode.stream_applies(p, None, None):
        with pytest.raises(ValueError, match="stream=True"):
            gpu_decode.forward(p, qg, kg, vg, _poisoned(qg.shape, qg.dtype), cupy.empty((b, hq, nq), np.float32),
                               stream=True)
        return
    for _ in range(2):
        o4 = _poisoned(qg.shape, qg.dtype)
        lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
        gpu_decode.forward(p, qg, kg, vg, o4, lse3, stream=True)
        check_per_sequence(o4, lse3, q, k, v, [nk] * b, causal, dtype)
    assert not gpu_hopper_flags_nonzero(b * hkv)


def gpu_hopper_flags_nonzero(n):
    from cuflash.gpu_hopper import split_flags

    return bool(split_flags(n)[:n].any())


@pytest.mark.parametrize("bs", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
def test_decode_stream_paged(monkeypatch, bs, causal):
    """Paged caches without kv_lens through the API, the stream kernel forced: pages read in place."""
    from test_paged import run_paged

    seen = []
    real = gpu_decode._forward_stream
    monkeypatch.setattr(gpu_decode, "STREAM", True)
    monkeypatch.setattr(gpu_decode, "_sm_count", lambda dev: 3)
    monkeypatch.setattr(gpu_decode, "_forward_stream", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    rng = np.random.default_rng(bs)
    run_paged(cupy, rng, BFLOAT16, 5, 32, 8, 1, 1280, 128, bs, None, causal)
    assert seen
