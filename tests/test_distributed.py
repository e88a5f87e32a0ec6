"""cuflash.distributed.ring_attention under gloo with P = 2, 3, 4 processes on the CPU (NumPy
backend): forward and backward of every rank's rows, reassembled, against the float64 reference by
the accuracy rule (cuflash.testing) - causal and not, GQA/MQA, the ring and the all-gather, zigzag
and contiguous shards, odd lengths (down to empty chunks). One spawn per P runs all its cases."""

from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _distributed_worker as worker  # noqa: E402
from _thread_ring import run_ring  # noqa: E402

from cuflash import distributed as cp  # noqa: E402
from _cp_cases import NUMPY, cases_for, check_case  # noqa: E402



def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, cases, timeout=90):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker.run, args=(r, world, port, cases, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, out, err = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_matches_the_reference(rng, world):
    cases = cases_for(world, int(rng.integers(2**31)))
    per_rank = _spawn(world, cases)
    for i, case in enumerate(cases):
        dt = NUMPY[case["dtype"]]
        q, k, v, do = (t.float().numpy().astype(dt) for t in worker.full_inputs(case))
        dim = 2 if case["layout"] == "bhsd" else 1
        o, lse, dq, dk, dv = (cp.unshard([torch.from_numpy(per_rank[r][i][j]) for r in range(world)],
                                         balance=case["balance"], dim=d).numpy()
                              for j, d in zip(range(5), (dim, 2, dim, dim, dim)))
        assert per_rank[0][i][5] == per_rank[0][i][6] == str(worker.TORCH[case["dtype"]])  # o, dq in q's dtype
        check_case(case, world, (q, k, v, do), (o, lse, dq, dk, dv))


def test_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 3 * 11 * 2).reshape(2, 3, 11, 2)
    for world in (1, 2, 3, 4):
        for balance in cp.BALANCES:
            shards = [cp.shard(x, r, world, balance=balance) for r in range(world)]
            assert sum(s.shape[2] for s in shards) == 11
            assert torch.equal(cp.unshard(shards, balance=balance), x)
    # zigzag: rank r holds chunks r and 2P - 1 - r
    assert [c for c, _, _ in cp.chunk_bounds(16, 4, "zigzag")[1]] == [1, 6]


def test_causal_work_is_balanced_by_zigzag():
    # pairs each rank computes over all steps, causal, N = 8P rows: equal under zigzag
    for world in (2, 4, 8):
        pairs = []
        for r in range(world):
            total = 0
            for _, qa, qb in cp.chunk_bounds(8 * world, world)[r]:
                total += sum(min(qb, i + 1) - 0 for i in range(qa, qb))  # keys j <= i
            pairs.append(total)
        assert len(set(pairs)) == 1, pairs


def test_validation(monkeypatch):
    class _Fake:
        pass
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        cp.ring_attention(np.zeros((1, 1, 2, 4)), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    t = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="mode"):
        cp.ring_attention(t, t, t, mode="tree")
    with pytest.raises(ValueError, match="balance"):
        cp.ring_attention(t, t, t, balance="random")
    with pytest.raises(ValueError, match="causal"):
        cp.ring_attention(t, t, t, causal="top_left")
    with pytest.raises(ValueError, match="q: expected a 4-D"):
        cp.ring_attention(t[0], t[0], t[0])
    with pytest.raises(ValueError, match="k, v: this rank's rows"):
        cp.ring_attention(t, torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))


def test_import_cuflash_does_not_import_the_distributed_adapter():
    import subprocess
    import sys

    code = "import sys, cuflash; assert 'cuflash.distributed' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_simulated_in_threads_matches_the_reference(rng, world):
    # the same algorithm with the ranks as threads of this process (the single-GPU tests' harness)
    for case in cases_for(world, int(rng.integers(2**31))):
        full = worker.full_inputs(case)
        per_rank = run_ring(case, world, full)
        dim = 2 if case["layout"] == "bhsd" else 1
        res = [cp.unshard([per_rank[r][j] for r in range(world)], balance=case["balance"], dim=d).numpy()
               for j, d in zip(range(5), (dim, 2, dim, dim, dim))]
        dt = NUMPY[case["dtype"]]
        check_case(case, world, [t.float().numpy().astype(dt) for t in full], res)
