"""Context parallelism for JAX: exact attention of one long sequence sharded along a mesh axis.

:func:`ring_attention` is called inside ``jax.shard_map`` on each device's rows of q, k and v
(sharded along the sequence axis over ``axis_name``) and returns those rows' attention over the
whole sequence, differentiably (``jax.custom_vjp``):

- ``mode="ring"``: the K/V blocks travel around the mesh axis (``lax.ppermute``; the next block's
  transfer does not depend on this step's compute, so XLA may overlap them); each device merges
  its float32 partial results (o, lse) by the exact log-sum-exp rule; the backward recomputes each
  step from the global o and lse, and the dK/dV of a block travel with it back to its owner.
- ``mode="allgather"``: K and V are gathered whole (``lax.all_gather``; cheap with GQA/MQA); each
  device's queries run against every key chunk they see; the backward's dK/dV are summed back to
  their owners (``lax.psum_scatter``).
- ``mode="auto"``: the all-gather when ``Hq >= P * Hkv`` (cuflash.core.sequence_split.pick_mode).

Load balance: with ``balance="zigzag"`` (default) device r of P holds chunks r and 2P - 1 - r of the
sequence cut into 2P equal chunks, so causal work is even; ``"contiguous"`` holds chunk r of P.
shard_map cuts an array into equal consecutive blocks, so put the sequence in that order first with
:func:`to_ring_order` and take results back with :func:`from_ring_order`. The sequence length must
be a multiple of 2P (zigzag) or P (contiguous).

Each step is one cuflash call through ``buffer_callback`` (cuflash.jax), with float32 partial
results (the 16-bit inputs' float32 epilogue) and float32 gradients (the float32 backward on
widened inputs, as cuflash.distributed does), so the merge and the sums round once. Which chunk
pairs a device computes depends on its index on the axis, a traced value: each pair is a
``lax.switch`` between the full, the causal-diagonal and the empty case.

docs/distributed.md explains the modes, the balance and the cost model. Imported only on request:
``import cuflash`` never imports JAX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import jax as adapter
from .api import functional as api
from .core import problem
from .core.sequence_split import BALANCES, MODES, check_choice, pick_mode

jax, jnp = adapter.jax, adapter.jnp
lax = jax.lax

__all__ = ["ring_attention", "to_ring_order", "from_ring_order"]

LAYOUTS = ("bhsd", "bshd")


# ----------------------------------------------------------------------------- sequence order


def _chunk_count(world, balance):
    check_choice("balance", balance, BALANCES)
    return 2 * world if balance == "zigzag" else world


def _ring_chunk_order(world, balance):
    """Global chunk indices in the order shard_map's equal blocks hand them out."""
    if balance == "zigzag":
        return [c for r in range(world) for c in (r, 2 * world - 1 - r)]
    return list(range(world))


def _check_ordered_length(n, world, balance, name="x"):
    chunks = _chunk_count(world, balance)
    if n % chunks:
        raise ValueError(f"{name}: a sequence of {n} rows does not cut into {chunks} equal chunks "
                         f"(balance={balance!r} on {world} devices); pad it to a multiple of {chunks}")
    return n // chunks


def to_ring_order(x, world: int, *, balance: str = "zigzag", axis: int = 2):
    """x (a whole sequence along ``axis``: 2 for bhsd q/k/v, 1 for bshd) reordered so that cutting
    it into ``world`` equal consecutive blocks gives device r its chunks (zigzag: r and 2P-1-r)."""
    c = _check_ordered_length(x.shape[axis], world, balance)
    pieces = [lax.slice_in_dim(x, i * c, (i + 1) * c, axis=axis) for i in _ring_chunk_order(world, balance)]
    return jnp.concatenate(pieces, axis=axis)


def from_ring_order(x, world: int, *, balance: str = "zigzag", axis: int = 2):
    """The inverse of :func:`to_ring_order` (for o, lse, gradients gathered from shard_map)."""
    c = _check_ordered_length(x.shape[axis], world, balance)
    order = _ring_chunk_order(world, balance)
    where = {chunk: pos for pos, chunk in enumerate(order)}
    pieces = [lax.slice_in_dim(x, where[i] * c, (where[i] + 1) * c, axis=axis) for i in range(len(order))]
    return jnp.concatenate(pieces, axis=axis)


# ----------------------------------------------------------------------------- one step


@functools.lru_cache(maxsize=None)
def _step_forward_callback(causal, scale, layout):
    def callback(ctx, outs, q, k, v):
        o_buf, lse_buf = outs
        with adapter._Native(ctx, q) as native:
            qn, kn, vn, on, lsen = (native.wrap(b) for b in (q, k, v, o_buf, lse_buf))
            _, lse = api.attention(qn, kn, vn, causal=causal, scale=scale, layout=layout, return_lse=True, out=on,
                                   out_dtype=np.float32)
            lsen[...] = lse

    return callback


@functools.lru_cache(maxsize=None)
def _step_backward_callback(causal, scale, layout):
    def callback(ctx, outs, do, q, k, v, o, lse):
        with adapter._Native(ctx, q) as native:
            args = [native.wrap(b) for b in (do, q, k, v, o, lse)]
            api.attention_backward(*args, causal=causal, scale=scale, layout=layout,
                                   out=tuple(native.wrap(b) for b in outs))

    return callback


def _lse_of(q, layout):
    b, h, n = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    return (b, h, n)


def _step_forward(q, k, v, causal, scale, layout):
    """(o float32, lse float32) of q's rows over these keys."""
    o_shape = (*q.shape[:-1], v.shape[-1])  # v's head dim may differ from q's
    result = (jax.ShapeDtypeStruct(o_shape, jnp.float32), jax.ShapeDtypeStruct(_lse_of(q, layout), jnp.float32))
    call = adapter.buffer_callback(_step_forward_callback(causal, scale, layout), result)
    return adapter._varying_like(call(q, k, v), (q, k, v))


def _step_backward(do, q, k, v, o, lse, causal, scale, layout):
    """float32 (dq, dk, dv) of one step, from the global o and lse (float32 inputs)."""
    result = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = adapter.buffer_callback(_step_backward_callback(causal, scale, layout), result)
    return adapter._varying_like(call(do, q, k, v, o, lse), (do, q, k, v, o, lse))


def _causal_case(q_chunk, k_chunk):
    """The branch of a causal chunk pair: 0 full (the key chunk comes first), 1 the diagonal, 2 no
    pair (core.sequence_split.relation, for traced chunk indices)."""
    return jnp.where(k_chunk < q_chunk, 0, jnp.where(k_chunk == q_chunk, 1, 2))


def _pair_forward(q_chunk, k_chunk, q, k, v, static):
    causal, scale, layout = static.causal, static.scale, static.layout
    if not causal:
        return _step_forward(q, k, v, False, scale, layout)

    def empty(q, k, v):
        o = jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32)
        lse = jnp.full(_lse_of(q, layout), -jnp.inf, jnp.float32)
        return adapter._varying_like((o, lse), (q, k, v))

    return lax.switch(_causal_case(q_chunk, k_chunk),
                      [lambda *a: _step_forward(*a, False, scale, layout),
                       lambda *a: _step_forward(*a, True, scale, layout), empty], q, k, v)


def _pair_backward(q_chunk, k_chunk, do, q, k, v, o, lse, static):
    causal, scale, layout = static.causal, static.scale, static.layout
    if not causal:
        return _step_backward(do, q, k, v, o, lse, False, scale, layout)

    def empty(do, q, k, v, o, lse):
        zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
        return adapter._varying_like(zeros, (do, q, k, v, o, lse))

    return lax.switch(_causal_case(q_chunk, k_chunk),
                      [lambda *a: _step_backward(*a, False, scale, layout),
                       lambda *a: _step_backward(*a, True, scale, layout), empty], do, q, k, v, o, lse)


def _merge(a, b, layout):
    """The exact log-sum-exp merge of two float32 partial results (o, lse) of the same rows."""
    (o_a, l_a), (o_b, l_b) = a, b
    m = jnp.maximum(l_a, l_b)
    m = jnp.where(jnp.isneginf(m), 0.0, m)  # a row neither part saw: weights 0, o 0, lse -inf
    w_a, w_b = jnp.exp(l_a - m), jnp.exp(l_b - m)
    total = w_a + w_b
    seen = total > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    w_a, w_b = w_a / jnp.where(seen, total, 1.0), w_b / jnp.where(seen, total, 1.0)
    if layout == "bshd":
        w_a, w_b = jnp.swapaxes(w_a, 1, 2), jnp.swapaxes(w_b, 1, 2)
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


# ----------------------------------------------------------------------------- the passes


@dataclass(frozen=True)
class _Static:
    """The options of one call, hashable (custom_vjp's nondiff argument), and the geometry they
    give: the sequence axis, a device's chunks, the ring's permutation."""

    causal: bool
    scale: float
    layout: str
    mode: str
    balance: str
    axis_name: object
    world: int

    @property
    def axis(self):
        return 2 if self.layout == "bhsd" else 1

    def chunks_of(self, rank):
        """A device's chunk indices (rank may be traced)."""
        if self.balance == "zigzag":
            return (rank, 2 * self.world - 1 - rank)
        return (rank,)

    def split(self, x, axis=None):
        """x's rows (along the sequence axis, or ``axis``: -1 for lse) cut into the device's chunks."""
        axis = self.axis if axis is None else axis % x.ndim
        parts = 2 if self.balance == "zigzag" else 1
        c = x.shape[axis] // parts
        return [lax.slice_in_dim(x, i * c, (i + 1) * c, axis=axis) for i in range(parts)]

    def join(self, xs, axis=None):
        return jnp.concatenate(xs, axis=self.axis if axis is None else axis)

    def send_on(self, *xs):
        """Each x to the next device on the axis (device r's to r + 1)."""
        perm = [(i, (i + 1) % self.world) for i in range(self.world)]
        return tuple(lax.ppermute(x, self.axis_name, perm) for x in xs)


def _pairs(static, rank, src_chunks):
    """(query part index, key part index, query chunk, key chunk) of every causal pair to compute
    (without a mask every key is seen: one call per block over the whole rows)."""
    return [(j, i, qc, kc) for j, qc in enumerate(static.chunks_of(rank)) for i, kc in enumerate(src_chunks)]


def _forward(q, k, v, static):
    rank = lax.axis_index(static.axis_name)
    blocks = _ring_blocks(static, rank, k, v) if static.mode == "ring" else _gathered_blocks(static, k, v)
    # Without a mask the device's rows are one part seeing every key; with one, each of its chunks
    # is a part of its own, merged over the key chunks it sees.
    q_parts = static.split(q) if static.causal else [q]
    acc = [None] * len(q_parts)
    for src_chunks, k_blk, v_blk in blocks:
        if static.causal:
            k_parts, v_parts = static.split(k_blk), static.split(v_blk)
            steps = [(j, _pair_forward(qc, kc, q_parts[j], k_parts[i], v_parts[i], static))
                     for j, i, qc, kc in _pairs(static, rank, src_chunks)]
        else:
            steps = [(0, _pair_forward(None, None, q, k_blk, v_blk, static))]
        for j, part in steps:
            acc[j] = part if acc[j] is None else _merge(acc[j], part, static.layout)
    o, lse = static.join([a[0] for a in acc]), static.join([a[1] for a in acc], axis=-1)
    return o.astype(q.dtype), lse


def _ring_blocks(static, rank, k, v):
    """(source chunks, k block, v block) of each ring step; the next block is sent before this
    step's pairs are computed, so the transfer can overlap them."""
    k_cur, v_cur = k, v
    for step in range(static.world):
        src = (rank - step) % static.world
        nxt = static.send_on(k_cur, v_cur) if step < static.world - 1 else None
        yield static.chunks_of(src), k_cur, v_cur
        if nxt is not None:
            k_cur, v_cur = nxt


def _gathered_blocks(static, k, v):
    """(source chunks, k block, v block) of every device, from one all-gather of K and V."""
    kg = lax.all_gather(k, static.axis_name)
    vg = lax.all_gather(v, static.axis_name)
    for p in range(static.world):
        yield static.chunks_of(p), kg[p], vg[p]


def _backward(do, q, k, v, o, lse, static):
    rank = lax.axis_index(static.axis_name)
    f32 = jnp.float32
    do_w, q_w, o_w = do.astype(f32), q.astype(f32), o.astype(f32)
    if static.mode == "ring":
        dq, dk, dv = _ring_backward(static, rank, do_w, q_w, k, v, o_w, lse)
    else:
        dq, dk, dv = _gathered_backward(static, rank, do_w, q_w, k, v, o_w, lse)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _block_backward(static, rank, src_chunks, do, q, k_blk, v_blk, o, lse):
    """float32 (dq, dk_blk, dv_blk): this device's rows' contribution against one K/V block."""
    f32 = jnp.float32
    k_w, v_w = k_blk.astype(f32), v_blk.astype(f32)
    if not static.causal:
        return _pair_backward(None, None, do, q, k_w, v_w, o, lse, static)
    q_parts, do_parts, o_parts = static.split(q), static.split(do), static.split(o)
    lse_parts = static.split(lse, axis=-1)
    k_parts, v_parts = static.split(k_w), static.split(v_w)
    dq = [jnp.zeros(x.shape, f32) for x in q_parts]
    dk = [jnp.zeros(x.shape, f32) for x in k_parts]
    dv = [jnp.zeros(x.shape, f32) for x in v_parts]
    for j, i, qc, kc in _pairs(static, rank, src_chunks):
        g = _pair_backward(qc, kc, do_parts[j], q_parts[j], k_parts[i], v_parts[i], o_parts[j], lse_parts[j], static)
        dq[j], dk[i], dv[i] = dq[j] + g[0], dk[i] + g[1], dv[i] + g[2]
    return static.join(dq), static.join(dk), static.join(dv)


def _ring_backward(static, rank, do, q, k, v, o, lse):
    dq = jnp.zeros(q.shape, jnp.float32)
    dk_acc = jnp.zeros(k.shape, jnp.float32)  # the gradient of the block this device holds now
    dv_acc = jnp.zeros(v.shape, jnp.float32)
    for src_chunks, k_blk, v_blk in _ring_blocks(static, rank, k, v):
        g = _block_backward(static, rank, src_chunks, do, q, k_blk, v_blk, o, lse)
        dq = dq + g[0]
        # on with the block; after the last step the sums reach the block's owner
        dk_acc, dv_acc = static.send_on(dk_acc + g[1], dv_acc + g[2])
    return dq, dk_acc, dv_acc


def _gathered_backward(static, rank, do, q, k, v, o, lse):
    dq = jnp.zeros(q.shape, jnp.float32)
    dks, dvs = [], []
    for src_chunks, k_blk, v_blk in _gathered_blocks(static, k, v):
        g = _block_backward(static, rank, src_chunks, do, q, k_blk, v_blk, o, lse)
        dq = dq + g[0]
        dks.append(g[1])
        dvs.append(g[2])
    # every device's contribution to block p, summed on device p
    dk = lax.psum_scatter(jnp.stack(dks), static.axis_name, scatter_dimension=0, tiled=False)
    dv = lax.psum_scatter(jnp.stack(dvs), static.axis_name, scatter_dimension=0, tiled=False)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _context_parallel(q, k, v, static):
    return _forward(q, k, v, static)


def _context_parallel_fwd(q, k, v, static):
    o, lse = _forward(q, k, v, static)
    return (o, lse), (q, k, v, o, lse)


def _context_parallel_bwd(static, saved, cotangents):
    q, k, v, o, lse = saved
    grads = _backward(cotangents[0], q, k, v, o, lse, static)  # lse is not differentiable
    return adapter._varying_like(grads, (q, k, v))


_context_parallel.defvjp(_context_parallel_fwd, _context_parallel_bwd)


# ----------------------------------------------------------------------------- the entry point


def ring_attention(q, k, v, *, axis_name, causal=False, scale=None, layout="bhsd", mode="auto", balance="zigzag",
                   return_lse=False):
    """Exact attention of this device's query rows over the whole sequence sharded along the mesh
    axis ``axis_name``; call it inside ``jax.shard_map`` (differentiable, jit-able).

    q, k, v : this device's rows, 4-D (B, H, n, d) for ``layout="bhsd"`` or (B, n, H, d) for
        ``"bshd"``, from a sequence put in ring order by :func:`to_ring_order` for ``balance`` and
        sharded along its sequence axis (``PartitionSpec(None, None, axis_name, None)`` for bhsd);
        k, v may have fewer heads (GQA/MQA). float16, bfloat16 or float32.
    causal : False or True (one sequence attending to itself: query i sees keys j <= i).
    mode : "ring", "allgather" or "auto" (cuflash.core.sequence_split.pick_mode).
    return_lse : also return the rows' global lse (float32 (B, Hq, n), not differentiable).

    Returns o (this device's rows, q's dtype and layout), or (o, lse).
    """
    check_choice("layout", layout, LAYOUTS)
    check_choice("mode", mode, MODES)
    check_choice("balance", balance, BALANCES)
    problem.check_flag("return_lse", return_lse)
    if causal not in (False, True):
        raise ValueError(f"causal: expected False or True (one sequence attending to itself), got {causal!r}")
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D array ({'B, H, n, d' if layout == 'bhsd' else 'B, n, H, d'}), "
                             f"got shape {tuple(t.shape)}")
    ax = 2 if layout == "bhsd" else 1
    if k.shape[ax] != q.shape[ax]:
        raise ValueError(f"k: this device's rows must be q's ({q.shape[ax]} along the sequence axis), got k "
                         f"{tuple(k.shape)}")
    p = adapter._problem_of(q, k, v, False, scale, layout)  # dtypes, heads, head dims: errors by name
    try:
        world = int(lax.axis_size(axis_name))
    except NameError as exc:
        raise ValueError(f"axis_name: {axis_name!r} is not a mesh axis bound here; call ring_attention inside "
                         "jax.shard_map over that axis") from exc
    parts = 2 if balance == "zigzag" else 1
    if q.shape[ax] % parts:
        raise ValueError(f"q: {q.shape[ax]} rows per device do not cut into the {parts} equal chunks of "
                         f"balance={balance!r}; make the sequence a multiple of {parts * world}")
    hq, hkv = (q.shape[1], k.shape[1]) if layout == "bhsd" else (q.shape[2], k.shape[2])
    if mode == "auto":
        mode = pick_mode(hq, hkv, world)
    static = _Static(bool(causal), p.scale, layout, mode, balance, axis_name, world)
    o, lse = _context_parallel(q, k, v, static)
    lse = lax.stop_gradient(lse)
    return (o, lse) if return_lse else o
