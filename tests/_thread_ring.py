"""Ranks simulated as threads of one process: a communicator for cuflash.distributed.ring_attention
(its ``group=`` duck type) whose P2P messages and collectives are copies between the threads'
tensors, so the ring runs in one process on the CPU or on one GPU."""

from __future__ import annotations

import threading

import torch

from cuflash.distributed import ring_attention, shard

TIMEOUT = 120


class ThreadGroup:
    def __init__(self, world):
        self.world = world
        self.cond = threading.Condition()
        self.mail = {}  # (sender, receiver, sequence number) -> tensors
        self.sent = [0] * world
        self.posted = [0] * world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT)


class _Recv:
    def __init__(self, group, key, recv):
        self.group, self.key, self.recv = group, key, recv

    def wait(self):
        with self.group.cond:
            if not self.group.cond.wait_for(lambda: self.key in self.group.mail, timeout=TIMEOUT):
                raise TimeoutError(f"no message {self.key}")
            items = self.group.mail.pop(self.key)
        for dst, src in zip(self.recv, items):
            dst.copy_(src)


class ThreadComm:
    """One rank's view; messages match in posting order per (sender, receiver), as NCCL's do."""

    def __init__(self, group, rank):
        self.group, self.rank, self.world = group, rank, group.world

    def exchange(self, send, recv):
        g, nxt, prv = self.group, (self.rank + 1) % self.world, (self.rank - 1) % self.world
        with g.cond:
            g.mail[(self.rank, nxt, g.sent[self.rank])] = [t.clone() for t in send]
            g.sent[self.rank] += 1
            g.cond.notify_all()
        key = (prv, self.rank, g.posted[self.rank])
        g.posted[self.rank] += 1
        return [_Recv(g, key, recv)]

    def all_gather(self, out, t):
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        for i, o in enumerate(out):
            o.copy_(g.slots[i])
        g.barrier.wait()

    def all_reduce(self, t):
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        total = g.slots[0].clone()
        for s in g.slots[1:]:  # rank order: every rank sums alike
            total += s
        g.barrier.wait()
        t.copy_(total)


def run_ring(case, world, full, device="cpu"):
    """(o, lse, dq, dk, dv) of every rank (lists in rank order, float32 on the CPU) for the full
    inputs ``full`` = (q, k, v, do) torch tensors, the ranks as threads."""
    group = ThreadGroup(world)
    dim = 2 if case["layout"] == "bhsd" else 1
    n = full[0].shape[dim]
    results, errors = [None] * world, []

    def body(rank):
        try:
            q, k, v, do = (shard(t, rank, world, balance=case["balance"], dim=dim).to(device) for t in full)
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            o, lse = ring_attention(q, k, v, group=ThreadComm(group, rank), causal=case["causal"],
                                    layout=case["layout"], mode=case["mode"], balance=case["balance"],
                                    seq_len=n, return_lse=True)
            if device == "cpu":
                o.backward(do)
                grads = (q.grad, k.grad, v.grad)
            else:
                # autograd runs every CUDA backward on one worker thread per device, where the
                # ranks' backward passes (each waiting for the others' messages) would deadlock:
                # the operator's backward node runs here, in the rank's thread.
                grads = o.grad_fn.apply(do, None)[:3]
                torch.cuda.synchronize()
            results[rank] = [t.detach().float().cpu() for t in (o, lse, *grads)]
        except BaseException as exc:  # re-raised in the caller
            errors.append((rank, exc))
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    if errors:
        raise errors[0][1]
    return results
