"""Context parallelism for torch tensors on a torch.distributed process group.

Each rank holds a slice of one long sequence (its rows of q, k and v); ``ring_attention`` computes
the rows' exact attention over the whole sequence, differentiably:

- ``mode="ring"``: the K/V slices travel around the ring of ranks (P2P send/recv, the next slice
  in flight while the current one is computed); each rank merges its partial results with
  :func:`cuflash.merge_attention_states` in float32; the backward recomputes each step from the
  global o and lse, and the dK/dV of a slice travel with it back to its owner.
- ``mode="allgather"``: K and V are gathered whole (cheap with GQA/MQA, where they are a fraction of
  q); each rank computes its own query rows against all keys they see (bottom-right causal against
  the gathered prefix), no merge; the backward sums dK/dV over the ranks (all-reduce).
- ``mode="auto"``: all-gather when the gathered K and V are no larger than twice the local q
  (``Hq >= P * Hkv``), else the ring.

Load balance (``balance``): the sequence is cut into chunks; ``"zigzag"`` (default) gives rank r
chunks r and 2P - 1 - r of 2P, so that under a causal mask every rank has the same work;
``"contiguous"`` gives rank r chunk r of P. :func:`shard` and :func:`unshard` cut and reassemble
tensors that way. docs/distributed.md explains the modes, the balance and the overlap model
(``python -m cuflash report --context-parallel P``).

Works with NCCL on GPUs (CUDA tensors, cuflash's kernels) and with gloo on CPUs (CPU tensors, the
NumPy backend). Imported only on request: ``import cuflash`` never imports torch.
"""

from __future__ import annotations

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised by the optional-import test
    raise ImportError("cuflash.distributed needs PyTorch (pip install torch); cuflash itself does not") from exc

import numpy as np

from .api import functional as api
from .api.merge import merge_attention_states
from .core.sequence_split import BALANCES, MODES, check_choice, chunk_bounds, pick_mode, relation

__all__ = ["ring_attention", "shard", "unshard", "chunk_bounds", "MODES", "BALANCES"]

LAYOUTS = ("bhsd", "bshd")


# ----------------------------------------------------------------------------- geometry


def _seq_axis(layout):
    return 2 if layout == "bhsd" else 1


def shard(x, rank: int, world: int, *, balance: str = "zigzag", dim: int = 2):
    """Rank ``rank``'s rows of the full tensor ``x`` along ``dim`` (2 for bhsd q/k/v and lse,
    1 for bshd): its chunks, concatenated in order."""
    n = x.shape[dim]
    return torch.cat([x.narrow(dim, a, b - a) for _, a, b in chunk_bounds(n, world, balance)[rank]], dim=dim)


def unshard(shards, *, balance: str = "zigzag", dim: int = 2):
    """The full tensor from every rank's shard (a list in rank order); inverse of :func:`shard`."""
    world = len(shards)
    n = sum(s.shape[dim] for s in shards)
    pieces = {}
    for r, s in enumerate(shards):
        off = 0
        for c, a, b in chunk_bounds(n, world, balance)[r]:
            pieces[c] = s.narrow(dim, off, b - a)
            off += b - a
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=dim)


class _Comm:
    """Ranks of one group, and the ring's P2P exchange."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def glob(self, r):
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def exchange(self, send, recv):
        """Post sends of ``send`` to the next rank and receives into ``recv`` from the previous
        one; returns the requests (``wait()`` each before reading ``recv``)."""
        nxt, prv = self.glob((self.rank + 1) % self.world), self.glob((self.rank - 1) % self.world)
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prv, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)

    def all_gather(self, out, t):
        dist.all_gather(out, t, group=self.group)

    def all_reduce(self, t):
        dist.all_reduce(t, group=self.group)


def _wait(reqs):
    for r in reqs:
        r.wait()


class _Plan:
    """The sequence's chunks on every rank and this rank's place in it."""

    def __init__(self, comm, n_local, device, balance, seq_len):
        self.comm = comm
        if seq_len is None:
            lens = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(comm.world)]
            comm.all_gather(lens, torch.tensor([n_local], dtype=torch.int64, device=device))
            lens = [int(t.item()) for t in lens]
            seq_len = sum(lens)
        else:
            lens = None
        self.n = int(seq_len)
        self.chunks = chunk_bounds(self.n, comm.world, balance)
        want = [sum(b - a for _, a, b in cs) for cs in self.chunks]
        if want[comm.rank] != n_local or (lens is not None and lens != want):
            raise ValueError(f"q: rank {comm.rank} holds {n_local} rows; balance={balance!r} of a sequence of "
                             f"{self.n} on {comm.world} ranks gives it {want[comm.rank]} (each rank's rows: {want})")
        self.lens = want

    def segments(self, r):
        """[(chunk, local offset, global start, global stop)] of rank r's rows."""
        out, off = [], 0
        for c, a, b in self.chunks[r]:
            out.append((c, off, a, b))
            off += b - a
        return out


def _seq(x, layout, off, n):
    return x.narrow(_seq_axis(layout), off, n)


def _kv_shape(k, layout, n):
    s = list(k.shape)
    s[_seq_axis(layout)] = n
    return tuple(s)


# ----------------------------------------------------------------------------- ring


def _ring_forward(q, k, v, plan, o_opts, partial_dtype):
    comm, layout = plan.comm, o_opts["layout"]
    rank, world = comm.rank, comm.world
    acc = {}
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for step in range(world):
        src = (rank - step) % world
        reqs = []
        if step < world - 1:  # the next slice travels while this one is computed
            nxt = (rank - step - 1) % world
            k_buf = k_cur.new_empty(_kv_shape(k, layout, plan.lens[nxt]))
            v_buf = v_cur.new_empty(_kv_shape(v, layout, plan.lens[nxt]))
            reqs = comm.exchange([k_cur, v_cur], [k_buf, v_buf])
        for c, qoff, qa, qb in plan.segments(rank):
            for kc, koff, ka, kb in plan.segments(src):
                rel = relation(o_opts["causal"], c, kc)
                if rel is None or qb == qa or kb == ka:
                    continue
                o_p, lse_p = api.attention(_seq(q, layout, qoff, qb - qa), _seq(k_cur, layout, koff, kb - ka),
                                           _seq(v_cur, layout, koff, kb - ka), causal=rel == "causal",
                                           scale=o_opts["scale"], layout=layout, return_lse=True,
                                           out_dtype=partial_dtype)
                if c in acc:
                    o_a, lse_a = acc[c]
                    o_p, lse_p = merge_attention_states(torch.stack([o_a, o_p.float()]), torch.stack([lse_a, lse_p]),
                                                        layout=layout, dtype=np.float32)
                acc[c] = (o_p.float(), lse_p)
        if reqs:
            _wait(reqs)
            k_cur, v_cur = k_buf, v_buf
    return _assemble(q, plan, acc, layout, v.shape[-1])


def _assemble(q, plan, acc, layout, dv):
    """(o in q's dtype, lse float32) of this rank's rows from the merged results per chunk."""
    os_, lses = [], []
    for c, qoff, qa, qb in plan.segments(plan.comm.rank):
        if qb == qa:
            continue
        o_c, lse_c = acc[c]  # every row sees its own chunk (causal) or every key
        os_.append(o_c)
        lses.append(lse_c)
    if not os_:
        lse_shape = tuple(q.shape[:1]) + ((q.shape[1], 0) if layout == "bhsd" else (q.shape[2], 0))
        o_shape = (*q.shape[:-1], dv)  # v's head dim
        return q.new_empty(o_shape), torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return torch.cat(os_, dim=_seq_axis(layout)).to(q.dtype), torch.cat(lses, dim=-1)


def _wide(x, partial_dtype):
    return x.float() if partial_dtype is not None else x


def _ring_backward(do, q, k, v, o, lse, plan, o_opts, partial_dtype):
    comm, layout = plan.comm, o_opts["layout"]
    rank, world = comm.rank, comm.world
    ax = _seq_axis(layout)
    do_w, q_w, o_w = (_wide(x, partial_dtype) for x in (do, q, o))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # this step's block: our own
    dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    acc_reqs, dk_in, dv_in = [], None, None
    for step in range(world):
        src = (rank - step) % world
        reqs = []
        if step < world - 1:
            nxt = (rank - step - 1) % world
            k_buf = k_cur.new_empty(_kv_shape(k, layout, plan.lens[nxt]))
            v_buf = v_cur.new_empty(_kv_shape(v, layout, plan.lens[nxt]))
            reqs = comm.exchange([k_cur, v_cur], [k_buf, v_buf])
        dk_p = torch.zeros(k_cur.shape, dtype=torch.float32, device=k.device)
        dv_p = torch.zeros(v_cur.shape, dtype=torch.float32, device=v.device)
        k_w, v_w = _wide(k_cur, partial_dtype), _wide(v_cur, partial_dtype)
        for c, qoff, qa, qb in plan.segments(rank):
            for kc, koff, ka, kb in plan.segments(src):
                rel = relation(o_opts["causal"], c, kc)
                if rel is None or qb == qa or kb == ka:
                    continue
                nq_, nk_ = qb - qa, kb - ka
                g = api.attention_backward(_seq(do_w, layout, qoff, nq_), _seq(q_w, layout, qoff, nq_),
                                           _seq(k_w, layout, koff, nk_), _seq(v_w, layout, koff, nk_),
                                           _seq(o_w, layout, qoff, nq_), lse.narrow(-1, qoff, nq_),
                                           causal=rel == "causal", scale=o_opts["scale"], layout=layout)
                dq.narrow(ax, qoff, nq_).add_(g[0].float())
                dk_p.narrow(ax, koff, nk_).add_(g[1].float())
                dv_p.narrow(ax, koff, nk_).add_(g[2].float())
        if acc_reqs:  # the block's dK/dV from the ranks it visited before
            _wait(acc_reqs)
            dk_acc, dv_acc = dk_in, dv_in
        dk_acc.add_(dk_p)
        dv_acc.add_(dv_p)
        if world > 1:  # on to the next rank; after the last step it reaches its owner
            nxt_block = (rank - step - 1) % world
            dk_in = torch.empty(_kv_shape(k, layout, plan.lens[nxt_block]), dtype=torch.float32, device=k.device)
            dv_in = torch.empty(_kv_shape(v, layout, plan.lens[nxt_block]), dtype=torch.float32, device=v.device)
            acc_reqs = comm.exchange([dk_acc, dv_acc], [dk_in, dv_in])
        if reqs:
            _wait(reqs)
            k_cur, v_cur = k_buf, v_buf
    if acc_reqs:
        _wait(acc_reqs)
        dk_acc, dv_acc = dk_in, dv_in
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


# ----------------------------------------------------------------------------- all-gather


def _gather_sequence(x, plan, layout):
    """The full sequence of x (every rank's rows in global order); ranks' rows padded to the
    longest for the collective, then trimmed."""
    comm, ax = plan.comm, _seq_axis(layout)
    longest = max(plan.lens)
    pad = list(x.shape)
    pad[ax] = longest
    buf = x.new_zeros(pad)
    buf.narrow(ax, 0, x.shape[ax]).copy_(x)
    parts = [torch.empty_like(buf) for _ in range(comm.world)]
    comm.all_gather(parts, buf)
    pieces = {}
    for r, part in enumerate(parts):
        for c, off, a, b in plan.segments(r):
            pieces[c] = part.narrow(ax, off, b - a)
    return torch.cat([pieces[c] for c in sorted(pieces)], dim=ax)


def _gather_forward(q, k, v, plan, o_opts):
    layout = o_opts["layout"]
    kf, vf = _gather_sequence(k, plan, layout), _gather_sequence(v, plan, layout)
    os_, lses = [], []
    for _, qoff, qa, qb in plan.segments(plan.comm.rank):
        if qb == qa:
            continue
        keys = qb if o_opts["causal"] else plan.n  # bottom-right causal: row i of the chunk sees keys <= qa + i
        o_c, lse_c = api.attention(_seq(q, layout, qoff, qb - qa), _seq(kf, layout, 0, keys), _seq(vf, layout, 0, keys),
                                   causal=bool(o_opts["causal"]), scale=o_opts["scale"], layout=layout,
                                   return_lse=True)
        os_.append(o_c)
        lses.append(lse_c)
    if not os_:
        return _assemble(q, plan, {}, layout, v.shape[-1])
    return torch.cat(os_, dim=_seq_axis(layout)), torch.cat(lses, dim=-1)


def _gather_backward(do, q, k, v, o, lse, plan, o_opts, partial_dtype):
    layout, ax = o_opts["layout"], _seq_axis(o_opts["layout"])
    kf, vf = _gather_sequence(k, plan, layout), _gather_sequence(v, plan, layout)
    do_w, q_w, o_w, kf_w, vf_w = (_wide(x, partial_dtype) for x in (do, q, o, kf, vf))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkf = torch.zeros(kf.shape, dtype=torch.float32, device=k.device)
    dvf = torch.zeros(vf.shape, dtype=torch.float32, device=v.device)
    for _, qoff, qa, qb in plan.segments(plan.comm.rank):
        if qb == qa:
            continue
        keys, n = (qb if o_opts["causal"] else plan.n), qb - qa
        g = api.attention_backward(_seq(do_w, layout, qoff, n), _seq(q_w, layout, qoff, n), _seq(kf_w, layout, 0, keys),
                                   _seq(vf_w, layout, 0, keys), _seq(o_w, layout, qoff, n), lse.narrow(-1, qoff, n),
                                   causal=bool(o_opts["causal"]), scale=o_opts["scale"], layout=layout)
        dq.narrow(ax, qoff, n).add_(g[0].float())
        dkf.narrow(ax, 0, keys).add_(g[1].float())
        dvf.narrow(ax, 0, keys).add_(g[2].float())
    plan.comm.all_reduce(dkf)  # every rank's contribution to every key
    plan.comm.all_reduce(dvf)
    own = [(a, b) for _, _, a, b in plan.segments(plan.comm.rank)]
    dk = torch.cat([dkf.narrow(ax, a, b - a) for a, b in own], dim=ax)
    dv = torch.cat([dvf.narrow(ax, a, b - a) for a, b in own], dim=ax)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- autograd


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, o_opts, mode, partial_dtype):
        if mode == "ring":
            o, lse = _ring_forward(q, k, v, plan, o_opts, partial_dtype)
        else:
            o, lse = _gather_forward(q, k, v, plan, o_opts)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.o_opts, ctx.mode, ctx.partial_dtype = plan, o_opts, mode, partial_dtype
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        run = _ring_backward if ctx.mode == "ring" else _gather_backward
        dq, dk, dv = run(do.contiguous(), q, k, v, o, lse, ctx.plan, ctx.o_opts, ctx.partial_dtype)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, layout="bhsd", mode="auto", balance="zigzag",
                   seq_len=None, return_lse=False):
    """Exact attention of this rank's query rows over the whole sequence held by the ranks of
    ``group`` (default: the world), with gradients through torch.autograd.

    ``group`` may also be a communicator: an object with ``world``, ``rank``, ``exchange(send,
    recv)`` (post sends to the next rank, receives from the previous, return objects to
    ``wait()``), ``all_gather(out_list, t)`` and ``all_reduce(t)`` (sum, in place), e.g. ranks
    simulated as threads of one process (the single-GPU tests do so).

    q, k, v : this rank's rows, 4-D torch tensors (B, H, n, d) for ``layout="bhsd"`` or (B, n, H, d)
        for ``"bshd"``, cut from the full sequence as :func:`shard` cuts it for ``balance``; k, v may
        have fewer heads (GQA/MQA). CUDA tensors run cuflash's kernels (NCCL group), CPU tensors the
        NumPy backend (gloo group).
    causal : False or True (one sequence attending to itself: query i sees keys j <= i).
    mode : "ring", "allgather" or "auto" (:func:`pick_mode`).
    Each step's partial o and gradients are kept in float32 (exact merge and sums, the result rounded
    once): the NumPy backend keeps its float32 accumulators; on the GPU the forward steps of 16-bit
    inputs run the mma.sync kernel's float32 epilogue (``cuflash.attention(out_dtype=float32)``)
    and the backward steps the float32 kernels on widened inputs (exact, slower).
    seq_len : the whole sequence's length, if known (else one all-gather of the ranks' lengths).
    return_lse : also return this rank's rows' global lse (float32, (B, Hq, n), not differentiable).

    Returns o (this rank's rows, q's dtype and layout), or (o, lse).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor ({'B, H, n, d' if layout == 'bhsd' else 'B, n, H, d'}), "
                             f"got shape {tuple(t.shape)}")
    check_choice("layout", layout, LAYOUTS)
    check_choice("mode", mode, MODES)
    check_choice("balance", balance, BALANCES)
    if causal not in (False, True):
        raise ValueError(f"causal: expected False or True (one sequence attending to itself), got {causal!r}")
    ax = _seq_axis(layout)
    if k.shape[ax] != q.shape[ax] or v.shape[:-1] != k.shape[:-1]:  # (v's head dim may differ)
        raise ValueError(f"k, v: this rank's rows must be q's ({q.shape[ax]} along the sequence axis), got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    comm = group if hasattr(group, "exchange") else _Comm(group)
    plan = _Plan(comm, q.shape[ax], q.device, balance, seq_len)
    hq, hkv = (q.shape[1], k.shape[1]) if layout == "bhsd" else (q.shape[2], k.shape[2])
    if mode == "auto":
        mode = pick_mode(hq, hkv, comm.world)
    partial_dtype = np.float32
    o_opts = {"causal": causal, "scale": scale, "layout": layout}
    o, lse = _ContextParallelAttention.apply(q, k, v, plan, o_opts, mode, partial_dtype)
    return (o, lse) if return_lse else o
