"""wgmma forward launches (cuda_src/attn_fwd_wgmma.cu, sm_90a) of a plan.dispatch.ForwardPlan:
tensor maps for the TMA-fed kernels, a persistent grid of one block per SM, the key split's
float32 partials and per-tile counters, and v's own head dim (the dv kernel)."""

from __future__ import annotations

import numpy as np

from ..plan.dispatch import ForwardPlan
from ..plan.hopper import split_partials
from . import counters, device, tma
from . import forward
from .operands import score_mod_args, sink_pointer


def launch(plan: ForwardPlan, p, q4, k4, v4, o4, lse3, *, persistent_blocks=None):
    """Launch a "wgmma", "wgmma_split", "wgmma_mod" or "wgmma_dv" plan. A persistent tile runs one
    block per SM, or `persistent_blocks` blocks (tests: a few blocks walk many tiles each). "wgmma_dv":
    v4 and o4 are p.dv wide, q4 and k4 p.d."""
    t = plan.tile

    def tensor_maps(qs, ks, vs):  # per launch chunk: the maps address that chunk's batch entries
        # (each map has its array's own columns: v's are dv wide in the dv kernel)
        return (tma.bhsd_map(qs, t.block_m), tma.bhsd_map(ks, t.block_n), tma.bhsd_map(vs, t.block_n))

    maps = tensor_maps if t.tma else None
    if plan.kernel == "wgmma_split":
        _launch_split(plan, p, q4, k4, v4, o4, lse3, maps)
        return
    if plan.kernel == "wgmma_dv":  # v's and o's head dim follows the plain arguments (d: q's and k's)
        forward.launch_forward(plan.spec, t.block_m, p, q4, k4, v4, o4, lse3, maps=maps,
                               chunk_args=lambda b0: (np.int32(p.dv),))
        return
    blocks = None
    if t.persistent:
        blocks = persistent_blocks or device.sm_count(device.current_id())
    if plan.kernel == "wgmma_mod":
        forward.launch_forward(plan.spec, t.block_m, p, q4, k4, v4, o4, lse3, maps=maps, persistent_blocks=blocks,
                               chunk_args=lambda b0: (*score_mod_args(p, b0), sink_pointer(p)))
        return
    forward.launch_forward(plan.spec, t.block_m, p, q4, k4, v4, o4, lse3, maps=maps, persistent_blocks=blocks)


def _launch_split(plan: ForwardPlan, p, q4, k4, v4, o4, lse3, maps):
    """attn_fwd_wgmma_tma_split with plan.splits pieces per query tile (one launch: a 1-D grid)."""
    import cupy

    t, splits = plan.tile, plan.splits
    tiles = -(-p.nq // t.block_m) * p.hq * p.batch
    slots, rows, hd = split_partials(p, t, splits)
    part_o = cupy.empty((max(slots, 1), rows, hd), dtype=np.float32)
    part_lse = cupy.empty((max(slots, 1), rows), dtype=np.float32)
    # A counter per query tile (cuflash.kernels.counters: kept per stream, left zero by each launch's
    # last pieces; a captured call's own, zeroed by a memset node on every replay).
    flags, _held = counters.for_cupy_launch(tiles, np.uint32)  # (_held: kept until launched)
    forward.launch_forward(plan.spec, t.block_m, p, q4, k4, v4, o4, lse3, maps=maps, blocks=splits * tiles,
                   extra_args=(np.int32(p.hq), np.int32(splits), part_o, part_lse, np.uint64(flags)))
