"""On the GPU: the bytes cuflash.memory_report predicts are the bytes the kernels allocate.

Every device allocation of one call is recorded through CuPy's allocator hook (requested sizes;
CuPy's pool then rounds each up to 512 bytes, which is not counted on either side). Inputs are
allocated before the call, so the record holds exactly what the call adds: outputs, saved state
and workspace, to be compared with the report's entries of those categories.
"""

import numpy as np
import pytest

import cuflash
from cuflash.kernels import device
from cuflash import accounting
from cuflash.core.arrays import BFLOAT16
from cuflash.core.fp8_inputs import E4M3
from cuflash.core.problem import validate_forward
from cuflash.testing import random_inputs, recorded_allocations
from cuflash.plan import decode as plan_decode
from cuflash.plan import hopper as plan_hopper

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

def _recorded(fn):
    """The allocation sizes of fn's second call (the first compiles and warms up)."""
    fn()
    return recorded_allocations(fn)[1]


def _predicted(report, categories):
    return sum(e.bytes for e in report.entries if e.category in categories)


def _inputs(shape_q, shape_kv, seed):
    rng = np.random.default_rng(seed)
    return tuple(cupy.asarray(a) for a in random_inputs(rng, shape_q, shape_kv, BFLOAT16))


@pytest.mark.parametrize("causal", [False, True])
def test_forward_bytes(causal):
    q, k, v = _inputs((2, 8, 1000, 128), (2, 8, 1000, 128), 1)
    sizes = _recorded(lambda: cuflash.attention(q, k, v, causal=causal, return_lse=True))
    rep = cuflash.memory_report(q, k, v, method="tiled", pass_="fwd", causal=causal)
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, rep.table())


def test_forward_bytes_key_split():
    # 32 query tiles of 16 key tiles: the forward splits them in halves (a grid under one wave) and
    # allocates the first halves' float32 partials; the counters were allocated by the warm-up call.

    q, k, v = _inputs((1, 2, 2048, 128), (1, 2, 2048, 128), 5)
    p = validate_forward(q, k, v)
    if cupy.cuda.Device().compute_capability != "90" or not plan_hopper.applies(p, True, device.current()):
        pytest.skip("the key split runs on sm_90's wgmma forward")
    assert plan_hopper.auto_split(p, cupy.cuda.Device().attributes["MultiProcessorCount"]) is not None
    sizes = _recorded(lambda: cuflash.attention(q, k, v, return_lse=True))
    rep = cuflash.memory_report(q, k, v, method="tiled", pass_="fwd")
    assert any("key split" in e.name for e in rep.entries), rep.table()
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, rep.table())


# d=64 and d=128: the warp-specialized wgmma kernel on Hopper (dQ accumulator rows padded to 64 per
# head); d=256: the mma.sync kernel; deterministic: the dQ kernel's row-major accumulator.
@pytest.mark.parametrize("d,causal,deterministic", [(128, False, False), (64, True, False), (256, False, False),
                                                    (128, True, True)])
def test_backward_bytes(d, causal, deterministic):
    q, k, v = _inputs((2, 8, 1000, d), (2, 8, 1000, d), 2)
    do = _inputs((2, 8, 1000, d), (2, 8, 1000, d), 3)[0]
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    sizes = _recorded(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                         deterministic=deterministic))
    rep = cuflash.memory_report(q, k, v, method="tiled", pass_="bwd", causal=causal, deterministic=deterministic)
    assert sum(sizes) == _predicted(rep, {"output", "workspace"}), (sizes, rep.table())


def test_decode_bytes():
    q, k, v = _inputs((4, 32, 1, 128), (4, 8, 8192, 128), 4)
    p = validate_forward(q, k, v, causal=True)
    sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    _, _, splits, _ = plan_decode.plan(p, sm)
    assert splits > 1  # this shape must exercise the partials
    sizes = _recorded(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True))
    rep = cuflash.memory_report(q, k, v, method="tiled", pass_="fwd", causal=True, splits=splits)
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, splits, rep.table())
    assert plan_decode.workspace_bytes(p, splits) == sum(sizes) - 2 * (4 * 32 * 128) - 4 * 32 * 4


# float8_e4m3fn q, k, v (CuPy uint8 bits with descales; sm_90): o, lse, vt and, where d % 16 != 0,
# the zero-padded copies of q and k (d % 8 != 0: the O scratch too); packed sequences: one band launch.
@pytest.mark.parametrize("q_shape, k_shape, layout, out_dtype, causal", [
    ((2, 8, 1000, 128), (2, 8, 1000, 128), "bhsd", None, False),
    ((2, 8, 300, 64), (2, 2, 999, 64), "bhsd", np.float16, True),
    ((1, 700, 4, 256), (1, 333, 1, 256), "bshd", None, True),
    ((2, 4, 257, 72), (2, 2, 130, 72), "bhsd", None, False),
    ((2, 100, 4, 100), (2, 77, 4, 100), "bshd", np.float16, False),
])
def test_e4m3_forward_bytes(q_shape, k_shape, layout, out_dtype, causal):
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the e4m3 forward kernel runs on sm_90 (Hopper)")
    rng = np.random.default_rng(6)
    q, k, v = (cupy.asarray(rng.standard_normal(s).astype(E4M3).view(np.uint8)) for s in (q_shape, k_shape, k_shape))
    heads_k = k_shape[-3] if layout == "bhsd" else k_shape[-2]
    qd, kd, vd = cupy.ones((), np.float32), cupy.full(k_shape[:-3] + (heads_k,), 0.5, np.float32), None
    sizes = _recorded(lambda: cuflash.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                                                layout=layout, out_dtype=out_dtype, return_lse=True))
    rep = cuflash.memory_report(q, k, v, q_descale=qd, k_descale=kd, causal=causal, layout=layout,
                                out_dtype=out_dtype)
    assert rep.dtype == "float8_e4m3fn" and any(e.name == "vt" for e in rep.entries)
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, rep.table())


@pytest.mark.parametrize("d", [128, 100])
def test_e4m3_packed_forward_bytes(d):
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the e4m3 forward kernel runs on sm_90 (Hopper)")
    rng = np.random.default_rng(7)
    nqs, nks = [100, 1, 257], [300, 33, 7]
    cq = cupy.asarray(np.cumsum([0] + nqs), dtype=np.int32)
    ck = cupy.asarray(np.cumsum([0] + nks), dtype=np.int32)
    q = cupy.asarray(rng.standard_normal((sum(nqs), 8, d)).astype(E4M3).view(np.uint8))
    k, v = (cupy.asarray(rng.standard_normal((sum(nks), 2, d)).astype(E4M3).view(np.uint8)) for _ in range(2))
    one = cupy.ones((), np.float32)
    sizes = _recorded(lambda: cuflash.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one, causal=True,
                                                cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True))
    rep = cuflash.memory_report(q, k, v, q_descale=one, k_descale=one, v_descale=one, causal=True,
                                cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, rep.table())
    # max_seqlen_* with validate=False: the offsets' clamped device copies join the workspace
    lengths = dict(max_seqlen_q=max(nqs), max_seqlen_k=max(nks), validate=False)
    sizes = _recorded(lambda: cuflash.attention(q, k, v, q_descale=one, k_descale=one, v_descale=one, causal=True,
                                                cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, **lengths))
    rep = cuflash.memory_report(q, k, v, q_descale=one, k_descale=one, v_descale=one, causal=True,
                                cu_seqlens_q=cq, cu_seqlens_k=ck, **lengths)
    assert any(e.name == "offsets (clamped)" for e in rep.entries)
    assert sum(sizes) == _predicted(rep, {"output", "saved state", "workspace"}), (sizes, rep.table())
