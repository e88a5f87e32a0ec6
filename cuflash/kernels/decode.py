"""Split-KV decode launches: the split kernel (attn_decode, attn_decode_cluster, attn_decode_tma)
and, where the plan says so, attn_decode_combine, on CuPy's current stream. The plan (row packing,
splits, tile, merge) comes from cuflash.plan.decode; launches are packed per geometry
(DecodeLaunch) so that a repeated geometry (cuflash.api.prepared) keeps them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..core.fp8_inputs import E4M3
from ..plan import dispatch
from ..plan.decode import (_COMBINE_THREADS, DecodePlan, _launch_problem_and_tile, _plan_launch, combine_grid,
                           e4m3_launch, last_split_merges, launch_plan, launch_spec, combine_spec, tma_spec)
from ..plan.spec import KernelSpec
from . import counters as stream_counters
from . import device, pdl, tma
from .build import get_function
from .operands import LOG2E as _LOG2E
from .operands import band_offsets, elem_strides, score_mod_args, sink_pointer, tma_ok



def _tma_maps(a4):
    """16-key boxes of a (B, H, N, d) K or V view (attn_decode_tma's ring stages)."""
    return tma.bhsd_map(a4, 16)




@functools.lru_cache(maxsize=512)
def _launch_scalars(p, strides, paged_shift, chunk, row_blocks_=1):
    """The scalar arguments of attn_decode / attn_decode_cluster after the page table, and the
    combine kernel's after its arrays, as NumPy scalars, per (problem, element strides of q, k, v,
    o and the page table, page shift, keys per split). A decode loop repeats one geometry, and
    building ~30 scalars per call cost about as much host time as the launches themselves."""
    q_s, k_s, v_s, o_s, table_stride = strides
    if paged_shift is not None:  # caches (num_blocks, block_size, Hkv, d): page, head, row strides
        kv = [np.int64(x) for e in (k_s, v_s) for x in (e[0], e[2], e[1])]
        pages = (np.int64(table_stride), np.int32(paged_shift))
    else:
        kv = [np.int64(x) for e in (k_s, v_s) for x in e[:3]]
        pages = (np.int64(0), np.int32(0))
    hi, lo, align = band_offsets(p)  # the causal limit and a window, as the band kernels take them
    os_ = tuple(np.int64(x) for x in o_s[:3])
    main = (*pages, *(np.int64(x) for x in q_s[:3]), *kv, *os_, np.int32(p.hq), np.int32(p.nq), np.int32(p.nk),
            np.int32(p.d), np.int32(p.group), np.int32(align), np.int32(chunk), np.float32(p.scale * _LOG2E),
            np.int32(lo), np.int32(hi), np.int32(row_blocks_))
    combine = (*os_, np.int32(p.hq), np.int32(p.hkv), np.int32(p.nq), np.int32(p.group), np.int32(p.d))
    return main, combine


class DecodeLaunch(NamedTuple):
    """One decode call's launches for a geometry: the split kernel and, with splits merged by a
    second kernel, attn_decode_combine. The arrays are supplied per call (main_args /
    combine_args), so a repeated geometry can keep this (cuflash.api.prepared)."""

    plan: DecodePlan
    spec: KernelSpec
    grid: tuple
    middle: tuple  # attn_decode's scalars after the page table (_launch_scalars)
    combine_tail: tuple  # attn_decode_combine's scalars after its arrays, before the split count
    rows: int  # packed (head, token) rows of one block's (sequence, K/V head, row block)
    problem: object  # the problem as launched (launch_problem: K/V heads x row blocks)

    @property
    def combines(self) -> bool:
        """The splits' partials go through a float32 workspace (merged by the last split or by
        attn_decode_combine: last_split_merges)."""
        return self.plan.splits > 1 and not self.plan.cluster

    def workspace_shapes(self):
        """(partial O, partial LSE) float32 shapes, or None without the combine kernel."""
        if not self.combines:
            return None
        p = self.problem
        head = (p.batch, p.hkv, self.plan.splits, self.rows)
        return head + (p.d,), head

    def main_args(self, q4, k4, v4, o4, lse3, part_o, part_lse, split_done, lens, table, kv_descales=None):
        """split_done: the pairs' split counters (counters.zeroed) for the merge by the last split,
        or a null pointer (one split, or attn_decode_combine merges). kv_descales: an e4m3 cache's
        (k descales, v descales, batch stride, head stride) (forward's), None for a 16-bit cache."""
        if self.plan.cluster:  # the cluster merges in shared memory: no workspace parameters
            args = (q4, k4, v4, o4, lse3, lens, table, *self.middle)
        else:
            args = (q4, k4, v4, o4, lse3, part_o, part_lse, split_done, lens, table, *self.middle)
        if kv_descales is not None:  # (attn_decode_kv8's last parameters)
            kd, vd, sb, sh = kv_descales
            args += (kd, vd, np.int64(sb), np.int64(sh))
        return args

    def combine_args(self, part_o, part_lse, o4, lse3):
        return _combine_args(part_o, part_lse, o4, lse3, self.combine_tail, self.plan.splits)

    def combine_grid(self):
        return combine_grid(self.problem, self.rows, self.plan.splits)


def _combine_args(part_o, part_lse, o4, lse3, combine_tail, splits):
    """attn_decode_combine's arguments (combine_tail: _launch_scalars' second part)."""
    return (part_o, part_lse, o4, lse3, *combine_tail, np.int32(splits))


def decode_launch(p, dev, strides, paged_shift=None, splits=None, tile=None, waves=None, cluster=None):
    """The DecodeLaunch of problem p on device `dev` for element strides (q, k, v, o, page
    table's row stride) and the page shift of a paged cache (None: contiguous K/V)."""
    sms = device.sm_count(dev)
    lpp, tile, own = _launch_problem_and_tile(p, sms, splits, tile, waves, cluster)
    r = lpp.hkv // p.hkv if p.hkv else 1
    p = lpp
    lp = _plan_launch(p, sms, splits, tile, waves, cluster, device.compute_capability(dev) >= 90, own)  # (launch_plan's plan)
    middle, combine_tail = _launch_scalars(p, strides, paged_shift, lp.chunk, r)
    spec = launch_spec(p.dtype, p.d, p.causal is not None, lp, p.window is not None, getattr(p, "modified", False))
    return DecodeLaunch(lp, spec, (lp.splits, p.hkv, p.batch), middle, combine_tail, p.group * p.nq, p)


def _word_strides(a4):
    """An e4m3 cache's strides in the 16-bit words attn_decode_kv8 addresses its bytes by (even:
    its rows are 16-byte aligned, plan.dispatch.decode_applies)."""
    return tuple(s // 2 for s in a4.strides)


def call_launch(p, dev, q4, k4, v4, o4, paged=None, kv8=False, splits=None, tile=None, waves=None, cluster=None):
    """The DecodeLaunch of one call's views (forward's arguments; the arrays' strides, not their
    addresses, enter it): element strides of q4, k4, v4, o4 and the page table's rows (`paged` =
    (block_table, block_size), None: contiguous K/V), an e4m3 cache's (`kv8`) in 16-bit words with
    plan.decode.e4m3_launch's tile and waves unless `tile` (one of kv_bytes 1) is given. forward
    and the prepared calls of cuflash.api.prepared plan their launches here."""
    if kv8:
        tile, waves = e4m3_launch(p, device.sm_count(dev), tile, waves)
        if tile.kv_bytes != 1 or tile.ring > 2:
            raise ValueError(f"tile={tile}: an e4m3 cache takes a tile of kv_bytes 1 and ring 0-2")
    kv_strides = _word_strides if kv8 else elem_strides
    table = paged[0] if paged is not None else None
    strides = (elem_strides(q4), kv_strides(k4), kv_strides(v4), elem_strides(o4),
               table.strides[0] // table.itemsize if table is not None else 0)
    shift = paged[1].bit_length() - 1 if paged is not None else None
    return decode_launch(p, dev, strides, shift, splits, tile, waves, cluster)


def forward(p, q4, k4, v4, o4, lse3, kv_lens=None, splits=None, tile=None, waves=None, tma_tile=None, paged=None,
            cluster=None, merge=None, kv_descales=None):
    """Split-KV decode of a validated problem. `tile` forces a cp.async tile, `tma_tile` the TMA
    kernel (sm_90, d 64/128, see plan.dispatch.decode_tma_applies): measured no faster than the
    cp.async kernel on the H200, so it runs only when asked for. `paged` = (block_table,
    block_size): k4 and v4 are then caches (num_blocks, block_size, Hkv, d). `cluster`: how the
    splits merge (see launch_plan): None picks, False forces the float32 workspace, True the cluster
    merge (ValueError where it cannot run). `merge`: how a workspace's partials merge, "last" (the
    last split of each pair), "kernel" (attn_decode_combine) or "auto"; None: MERGE.
    `kv_descales` = (k_descale, v_descale, batch stride, head stride): an e4m3 cache (k4 and v4
    float8_e4m3fn, or uint8 arrays of their bits) with its float32 device descales (strides 0, 0: one
    per tensor); its tile and waves come from plan.decode.e4m3_launch unless `tile` (one of kv_bytes 1) is
    given. Score modifiers (p.softcap, p.alibi, p.sinks) run attn_decode_mod /
    attn_decode_cluster_mod, on 16-bit caches and the cp.async kernel only."""
    import cupy

    dev = cupy.cuda.Device().id
    lens_ptr = kv_lens if kv_lens is not None else np.uint64(0)
    kv8 = kv_descales is not None
    if kv8 != (k4.dtype in (E4M3, np.uint8)):
        raise ValueError("kv_descales: given exactly when k and v hold e4m3 values (float8_e4m3fn or uint8 bits)")
    modified = getattr(p, "modified", False)
    if modified and (kv8 or tma_tile is not None):
        raise NotImplementedError("softcap=, alibi_slopes=, sinks=: the split-KV decode kernel takes them with "
                                  "16-bit caches on the cp.async kernel only (no kv_descales, no tma_tile)")
    if kv8 and tma_tile is not None:
        raise ValueError("tma_tile: the TMA decode kernel reads 16-bit caches only")
    if tma_tile is not None:
        _forward_tma(p, dev, q4, k4, v4, o4, lse3, lens_ptr, splits, waves, tma_tile, paged, cluster)
        return
    table = paged[0] if paged is not None else np.uint64(0)
    dl = call_launch(p, dev, q4, k4, v4, o4, paged, kv8, splits, tile, waves, cluster)
    p = dl.problem  # (K/V heads x row blocks from here on)
    ws = dl.workspace_shapes()
    split_done = np.uint64(0)  # (null: one split, a cluster merge, or the combine kernel's)
    if ws is not None:
        part_o, part_lse = (cupy.empty(shape, dtype=np.float32) for shape in ws)
        if last_split_merges(dl.plan, dl.rows, p.d, merge):
            address, _held = stream_counters.for_cupy_launch(p.batch * p.hkv)  # (_held: kept until launched)
            split_done = np.uint64(address)
    else:  # one split writes o and lse itself: null workspace pointers
        part_o = part_lse = np.uint64(0)
    spec = dl.spec
    args = dl.main_args(q4, k4, v4, o4, lse3, part_o, part_lse, split_done, lens_ptr, table, kv_descales)
    if modified:  # (the whole batch in one launch: slopes from sequence 0)
        args += (*score_mod_args(p), sink_pointer(p))
    get_function(spec)(dl.grid, (spec.threads,), args, shared_mem=spec.smem_bytes)
    if dl.combines and not split_done:
        _launch_combine(p, dl.combine_args(part_o, part_lse, o4, lse3), dl.combine_grid(),
                        combine_programmatic(p, splits=dl.plan.splits))


# The combine kernel runs as the split kernel's programmatic dependent (pdl.launch) when the
# cache read is at least this many bytes (~120 us on the H200): its blocks then wait on the device
# instead of launching after the last split (+0.3% at L=64k, B=8, Hkv=8), but the launch costs
# ~25-45 us more host time, which a shorter call (host-bound without a CUDA graph) would pay.
# A packed launch (cuflash.api.prepared, the plan cache) costs no more host time that way, so it
# always does: 1-2 us less per call on short caches (B=1 Hkv=8 L=32k, 24 splits: 45.5 vs 47.6 us;
# L=8k, 16 splits: 21.9 vs 22.8). Except from
# PDL_COMBINE_MAX_SPLITS splits on, where waiting on the device measured slower (one K/V head, Hq=32,
# B=1, the sliced combine: L=128k, 256 splits, 44.4 vs 37.0 us; L=32k, 128 splits, 24.5 vs 23.6;
# 33-64 splits within 1% either way).
PDL_COMBINE_MIN_BYTES = 512 << 20


PDL_COMBINE_MAX_SPLITS = 128


def combine_programmatic(p, packed: bool = False, splits: int = 1) -> bool:
    """Whether the combine kernel after `splits` splits runs as the split kernel's programmatic
    dependent (`packed`: launched from a packed_launch.PackedLaunch)."""
    if splits >= PDL_COMBINE_MAX_SPLITS:
        return False
    return packed or 2 * p.batch * p.hkv * p.nk * p.d * np.dtype(p.dtype).itemsize >= PDL_COMBINE_MIN_BYTES


def _launch_combine(p, args, grid, programmatic):
    """attn_decode_combine: the splits' partial O and LSE merged by the log-sum-exp rule (it waits
    for the partials on the device: griddepcontrol.wait)."""
    fn = get_function(combine_spec(p.dtype, p.d))
    if programmatic:
        pdl.launch(fn, grid, (_COMBINE_THREADS,), args, 0)
    else:
        fn(grid, (_COMBINE_THREADS,), args)


def _forward_tma(p, dev, q4, k4, v4, o4, lse3, lens_ptr, splits, waves, tma_tile, paged, cluster):
    """attn_decode_tma (asked for by tma_tile) and, with splits, the combine kernel."""
    import cupy

    lp = launch_plan(p, device.sm_count(dev), splits, tma_tile, waves, cluster, device.compute_capability(dev) >= 90)
    if paged is not None or p.window is not None:
        raise NotImplementedError("the TMA decode kernel is not wired to paged caches or windows on the host")
    if not dispatch.decode_tma_applies(p, tma_tile, device.target(dev), tma_ok(k4, v4)):
        raise ValueError("tma_tile: attn_decode_tma needs sm_90, cuda-bindings, d 64 or 128 and "
                         "TMA-addressable (16-byte aligned) K/V rows")
    rt, _, splits, chunk = lp[:4]
    rows = p.group * p.nq
    if splits > 1:
        part_o = cupy.empty((p.batch, p.hkv, splits, rows, p.d), dtype=np.float32)
        part_lse = cupy.empty((p.batch, p.hkv, splits, rows), dtype=np.float32)
    else:
        part_o = part_lse = cupy.empty((0,), dtype=np.float32)
    hi, lo, align = band_offsets(p)
    strides = (elem_strides(q4), elem_strides(k4), elem_strides(v4), elem_strides(o4), 0)
    _, combine_tail = _launch_scalars(p, strides, None, chunk)  # (the TMA maps carry K's and V's strides)
    os_ = combine_tail[:3]  # o's batch, head and row strides
    spec, _ = tma_spec(p.dtype, p.d, rt, p.causal is not None, tma_tile)
    get_function(spec)(
        (splits, p.hkv, p.batch), (spec.threads,),
        (_tma_maps(k4), _tma_maps(v4), q4, o4, lse3, part_o, part_lse, lens_ptr, np.uint64(0), np.int64(0),
         np.int32(0), *[np.int64(s) for s in elem_strides(q4)[:3]], *os_, np.int32(p.hq), np.int32(p.nq),
         np.int32(p.nk), np.int32(p.group), np.int32(align), np.int32(chunk), np.float32(p.scale * _LOG2E),
         np.int32(lo), np.int32(hi)),
        shared_mem=spec.smem_bytes,
    )
    if splits > 1:
        _launch_combine(p, _combine_args(part_o, part_lse, o4, lse3, combine_tail, splits), combine_grid(p, rows, splits),
                        combine_programmatic(p, splits=splits))
