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
