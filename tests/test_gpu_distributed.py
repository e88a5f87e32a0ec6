"""cuflash.distributed.ring_attention on one GPU with the ranks simulated as threads
(tests/_thread_ring.py): the per-step kernels (float32 partials of 16-bit inputs, the causal
diagonal chunks, the bottom-right causal all-gather), the CuPy merge and the backward from the
global o and lse, on CUDA torch tensors, reassembled and checked against the float64 reference by
the accuracy rule, as the gloo tests do on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without CUDA")]

from _cp_cases import NUMPY, cases_for, check_case  # noqa: E402
from _distributed_worker import full_inputs  # noqa: E402
from _thread_ring import run_ring  # noqa: E402

from cuflash import distributed as cp  # noqa: E402


def _check(case, world):
    full = full_inputs(case)
    per_rank = run_ring(case, world, full, device="cuda")
    dim = 2 if case["layout"] == "bhsd" else 1
    res = [cp.unshard([per_rank[r][j] for r in range(world)], balance=case["balance"], dim=d).numpy()
           for j, d in zip(range(5), (dim, 2, dim, dim, dim))]
    check_case(case, world, [t.float().numpy().astype(NUMPY[case["dtype"]]) for t in full], res)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_small_cases(rng, world):
    for case in cases_for(world, int(rng.integers(2**31))):
        _check(case, world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("mode,hkv", [("ring", 4), ("ring", 2), ("allgather", 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_tile_sized_cases(rng, world, dtype, mode, hkv, causal, d):
    # chunks of tens to hundreds of rows: the kernels' tiles, ragged ends and diagonal tiles
    case = dict(b=2, hq=4, hkv=hkv, n=96 * world + 5, d=d, dtype=dtype, causal=causal, mode=mode,
                layout="bhsd" if d == 64 else "bshd", balance="zigzag", seed=int(rng.integers(2**31)))
    _check(case, world)
