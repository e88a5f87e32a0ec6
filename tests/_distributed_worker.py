"""The per-rank body of tests/test_distributed.py (a module of its own: spawned processes import it)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from cuflash.distributed import ring_attention, shard

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def full_inputs(case):
    """The whole problem's q, k, v, do as torch tensors (every rank draws the same)."""
    rng = np.random.default_rng(case["seed"])
    b, hq, hkv, n, d = case["b"], case["hq"], case["hkv"], case["n"], case["d"]
    dv = case.get("dv", d)  # v's (and o's) head dim
    sq, skv = ((b, hq, n, d), (b, hkv, n, d)) if case["layout"] == "bhsd" else ((b, n, hq, d), (b, n, hkv, d))
    sv, so = skv[:-1] + (dv,), sq[:-1] + (dv,)
    dt = TORCH[case["dtype"]]
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dt) for s in (sq, skv, sv, so)]


def run(rank, world, port, cases, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = []
        for case in cases:
            dim = 2 if case["layout"] == "bhsd" else 1
            q, k, v, do = (shard(t, rank, world, balance=case["balance"], dim=dim) for t in full_inputs(case))
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            o, lse = ring_attention(q, k, v, causal=case["causal"], layout=case["layout"], mode=case["mode"],
                                    balance=case["balance"], return_lse=True)
            o.backward(do)
            out.append([t.detach().float().numpy() for t in (o, lse, q.grad, k.grad, v.grad)]
                       + [str(o.dtype), str(q.grad.dtype)])
        queue.put((rank, out, None))
    except Exception:  # reported by the parent
        import traceback

        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
