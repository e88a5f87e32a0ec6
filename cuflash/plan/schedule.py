"""Tile schedules: the one table of tile configurations, and which one a problem gets.

The same description drives the CUDA kernels (as template arguments) and the NumPy backend
(as its block sizes), so CPU tests exercise the tiling the GPU runs: ragged last tiles, skipped
fully-masked tiles, diagonal tiles that need the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.problem import MAX_HEAD_DIM
from .device_limits import H200

# Head dims are padded on chip to the next of these; the swizzled shared-memory layout needs a
# row of 32 elements or a multiple of 64 (8 chunks of 16 bytes), and loads zero-fill the padding.
HEAD_DIM_BUCKETS = (32, 64, 128, 192, 256)
assert HEAD_DIM_BUCKETS[-1] == MAX_HEAD_DIM  # validation (core.problem) admits exactly the tables' head dims


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per thread block
    block_n: int  # keys per K/V tile
    warps: int  # warps per block; each owns block_m / warps query rows
    stages: int  # K/V tiles in flight in the cp.async ring
    reason: str
    lazy_rescale: bool = True  # skip O's rescale when no row max moved (a vote + branch per tile)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the forward kernel: the Q tile plus `stages` K and V tiles."""
        return (self.block_m + 2 * self.stages * self.block_n) * head_dim * itemsize


# Forward, 16-bit inputs, mma.sync m16n8k16. Keyed by the padded head dim.
FORWARD_TILES: dict[int, TileConfig] = {
    32: TileConfig(128, 64, 4, 2, "as d=64 (eager rescale fits); 128-key tiles spill (S alone is 128 regs)", lazy_rescale=False),
    64: TileConfig(128, 64, 4, 2, "32 rows/warp, Q in registers (+5%), eager O rescale (+6.5% over the vote-and-branch); 3-4 stages no better; 128-key tiles spill", lazy_rescale=False),
    128: TileConfig(128, 64, 4, 2, "O is 128 regs/thread at 32 rows per warp, so K/V tiles shrink to 64 keys to keep S at 64 regs; eager rescale spills here, so lazy"),
    192: TileConfig(128, 64, 8, 2, "16 rows per warp: O alone is 96 regs; 8 warps keep the 128-row Q tile for K/V reuse"),
    256: TileConfig(128, 64, 8, 2, "16 rows per warp (O = 128 regs); 192 KiB shared memory, one block per SM"),
}


# Forward for inputs that cannot use 16-byte cp.async (d % 8 != 0, odd strides or misaligned
# pointers): element loads need extra registers, so each warp owns 16 rows (one mma tile).
FORWARD_TILES_SCALAR: dict[int, TileConfig] = {
    32: TileConfig(128, 64, 8, 2, "scalar loads: 16 rows per warp leaves room for the element-load registers"),
    64: TileConfig(128, 64, 8, 2, "scalar loads: 16 rows per warp leaves room for the element-load registers"),
    128: TileConfig(128, 64, 8, 2, "scalar loads: 16 rows per warp leaves room for the element-load registers"),
    192: TileConfig(128, 32, 8, 2, "scalar loads: 32-key tiles keep S small next to a 96-register O"),
    256: TileConfig(128, 32, 8, 2, "scalar loads: 32-key tiles keep S small next to a 128-register O"),
}


VT_BOX_KEYS = 128  # keys of one vt TMA box of the e4m3 forward (one 128-byte swizzled row)


def vt_slot_keys(block_n: int) -> int:
    """Keys of vt (the e4m3 forward's transposed V) a key tile of ``block_n`` loads: whole boxes
    (HopperFwdTraits::kVtKeys), the keys past the tile unused."""
    return -(-block_n // VT_BOX_KEYS) * VT_BOX_KEYS


@dataclass(frozen=True)
class HopperTile:
    """attn_fwd_wgmma: each warpgroup owns 64 query rows (wgmma's M), so block_m = 64 x warpgroups."""

    block_n: int  # keys per K/V tile (the N of Q K^T's wgmma, the K of P V's)
    warpgroups: int  # math warpgroups
    stages: int  # slots in each of the K and V cp.async rings (K runs one tile ahead of V); >= 2
    reason: str
    producer: bool = False  # warp specialization: one more warpgroup only loads (mbarrier handoff)
    tma: bool = False  # the producer is one thread issuing TMA copies (attn_fwd_wgmma_tma)
    pingpong: bool = False  # (TMA, 2 or 3 warpgroups) the math warpgroups take turns issuing GEMMs
    persistent: bool = False  # (TMA) one block per SM walks the query tiles (attn_fwd_wgmma_tma_persistent)
    wg_epilogue: bool = False  # (TMA) each math warpgroup stores its own O rows, no block-wide barrier

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def specialized(self) -> bool:
        return self.producer or self.tma

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.specialized)

    def smem_bytes(self, head_dim: int, itemsize: int = 2, head_dim_v: int | None = None) -> int:
        """Q tile + `stages` K and V tiles of `itemsize`-byte elements (+ the producer's mbarriers;
        persistent: + one more mbarrier and, 16-bit, O's staging tile), + 1 KiB to align the base to
        the 128-byte swizzle. ``head_dim_v``: V's (and O's) head dim where it is not Q's and K's
        (attn_fwd_wgmma_tma_dv). (e4m3, itemsize 1: per tile O's staging tile fits in Q's and the K
        ring's bytes; persistent O is stored from the accumulators.)"""
        hv = head_dim if head_dim_v is None else head_dim_v
        barriers = 8 * (1 + 4 * self.stages) if self.specialized else 0
        ring = self.stages * self.block_n * (head_dim + hv) * itemsize  # K's and V's slots
        if itemsize == 1:  # (e4m3) vt's slots hold whole 128-key boxes
            ring = self.stages * (self.block_n + vt_slot_keys(self.block_n)) * head_dim
        q_tile = self.block_m * head_dim * itemsize
        if self.persistent:  # + the "Q empty" barrier and (16-bit) O's own staging tile
            return q_tile + ring + (self.block_m * hv * 2 if itemsize == 2 else 0) + barriers + 8 + 1024
        return q_tile + ring + barriers + 1024


# Forward on Hopper (sm_90a), 16-bit inputs with 16-byte loads: the TMA-fed wgmma kernel
# (attn_fwd_wgmma_tma). Keyed by the padded head dim; other head dims and scalar-load inputs use
# FORWARD_TILES' mma.sync kernels. Chosen in sweeps next to cuDNN on the H200 (bf16, N 1k/4k/16k,
# causal and not; x = cuDNN ms / ours).
HOPPER_FORWARD_TILES: dict[int, HopperTile] = {
    64: HopperTile(128, 3, 2, "192x128, 3 math warpgroups at 160 regs (S 64 + O 32 + P 32) taking turns round robin (ping-pong): 0.88-1.11x cuDNN, own pace 0.71-1.08x, 2-warpgroup tiles 0.88-0.93x", tma=True, pingpong=True),
    128: HopperTile(128, 2, 2, "128x128, 240 regs per math thread; 2 stages (3 measured no faster): 0.88-1.08x cuDNN; ping-pong within noise of it, 160-key tiles no faster", tma=True),
    192: HopperTile(96, 2, 2, "96-key tiles fit 2 stages in 193 KiB: 0.90-1.12x cuDNN, 64-key tiles 0.87-1.00x; ping-pong ~1% ahead", tma=True, pingpong=True),
    256: HopperTile(64, 2, 2, "O is 128 regs + S 32 + P 16; 64-key tiles, each warpgroup storing its own O rows: 1-2.5% "
                    "ahead of 80-key tiles (N 1k-16k, causal and not, two runs) "
                    "since the late wgmma wait and the stale max (80 keys were +4-12% when first chosen)",
                    tma=True, wg_epilogue=True),
}

# Forward on Hopper with v's (and o's) head dim dv unlike q's and k's d (attn_fwd_wgmma_tma_dv, the
# per-tile TMA kernel with dv-wide V slots, O and P V): keyed by (d's bucket, dv's bucket). Other
# pairs, windows, packed sequences and score modifiers pad the narrower side to max(d, dv)
# (plan.dispatch.head_dim_v_plan). Register counts per math thread of the 240 that setmaxnreg
# gives two math warpgroups. Not yet measured on the GPU.
HOPPER_FORWARD_DV_TILES: dict[tuple[int, int], HopperTile] = {
    (192, 128): HopperTile(128, 2, 2, "128x128 (MLA prefill): O is 64 regs instead of the padded kernel's 96, so "
                           "128-key tiles fit (S 64 + O 64 + P 32 regs, as d=128's table tile); 2 stages = 209 KiB "
                           "(Q 48 + K 2x48 + V 2x32 KiB); ping-pong as d=192's table tile. H100: 657-746 TFLOP/s, "
                           "1.09-1.18x cuDNN at N = 4k-16k (padded to d=192: 0.52-0.89x)",
                           tma=True, pingpong=True),
    (128, 64): HopperTile(128, 2, 2, "128x128, S 64 + O 32 + P 32 regs; 2 stages = 129 KiB; own pace as d=128's "
                          "table tile, not searched. H100: 466-562 TFLOP/s, 0.80-1.02x cuDNN at N = 4k-16k "
                          "(padded: 0.56-0.86x)", tma=True),
}


# Forward on Hopper with float8_e4m3fn q, k, v (attn_fwd_wgmma_tma_fp8, wgmma m64nNk32): keyed by
# the e4m3 head-dim bucket (FP8_HEAD_DIMS: whole 128-byte rows of Q, K and vt). Key tiles are whole
# k32 steps with a WgmmaE4m3 wrapper (plan.hopper.FP8_KEY_TILES), vt's ring slots whole 128-key
# boxes (160-224-key tiles load up to 96 keys they do not use). At d=128 a key tile amortizes the
# step's fixed work (row maxima across the quad, the rescale vote, barriers, the wgmma waits) over
# more scores, up to 224 keys (S 112 + O 64 + P 28 registers); 256-key tiles spill (S 128 + O 64 +
# P 32). Searches (tools/e4m3_search.py), TFLOP/s at N = 8k / 16k (B x H = 2 x 16 / 1 x 16 at d=128,
# 2 x 8 / 1 x 8 at d=256), one pass per tile, bf16 out:
#   H200, d=128 (24 tiles of 128-256 keys, 2-4 stages, ping-pong or not): 128 keys 3 stages 868 /
#     922, causal 812 / 897; 192 keys 3 stages 906 / 930, causal 826 / 924; 224 keys 3 stages 904 /
#     940, causal 819 / 929 (x 1.041 / 1.020, causal 1.008 / 1.036); 224 keys 2 stages ping-pong
#     895 / 918, causal 837 / 934; 256 keys 689-860 (spills).
#   H100, d=128 (12 tiles of 128 keys): ping-pong 2 stages 763 / 787, causal 759 / 838; own pace 3
#     stages 837 / 867, causal 784 / 855 (2 stages 821 / 863, 782 / 858). Where the other
#     warpgroup's GEMMs would fill the softmax, the turns cost more than they hide, as at d=128 in
#     16 bits.
#   H100, d=256: own pace 2 stages 1225 / 1284, causal 1127 / 1227; 3 stages and ping-pong 0-2.2%
#     below (H200: the same order within 0.5%).
HOPPER_FP8_FORWARD_TILES: dict[int, HopperTile] = {
    128: HopperTile(224, 2, 3, "128x224, 3 stages, each warpgroup at its own pace (S 112 + O 64 + P 28 regs): "
                    "1.02-1.04x the 128-key tile without a mask, 1.01-1.04x causal (H200)", tma=True),
    256: HopperTile(128, 2, 2, "128x128, O 128 + S 64 + P 16 regs, own pace, 2 stages: the fastest of 4 tiles",
                    tma=True),
}
FP8_HEAD_DIMS = tuple(HOPPER_FP8_FORWARD_TILES)

# The e4m3 forward without a window or packed sequences on the persistent kernel
# (attn_fwd_wgmma_tma_fp8_persistent: one block per SM walks the query tiles, the next tile's Q and
# first K loading while this one ends), keyed by (head-dim bucket, causal); other keys, windows and
# packed sequences run HOPPER_FP8_FORWARD_TILES' per-tile kernel. It stores O from the
# accumulators (no staging tile: 224 keys in 3 stages and one would need 228 KiB). Search on H100
# (24 persistent tiles of 128-256 keys, 2-4 stages, each against the per-tile table's 128x224 s3,
# median of 3 rounds, B x H = 2 x 16 / 1 x 16 at N = 8k / 16k): causal, where the diagonal's short
# tiles leave SMs idle between blocks, 128x224 s3 with each warpgroup storing its own rows reads
# x1.052 / x1.017 (872 / 944 TFLOP/s); without a mask the best reads x1.010 / x0.973 (one block
# per SM runs ~1.0 waves of equal tiles either way: nothing to fill, and the ring's restart per
# tile costs), so non-causal stays per tile. d = 256 persistent is not searched yet.
HOPPER_FP8_FORWARD_PERSISTENT: dict[tuple[int, bool], HopperTile] = {
    (128, True): HopperTile(224, 2, 3, "128x224, 3 stages, persistent, per-warpgroup O stores: causal "
                            "x1.052 / x1.017 the per-tile kernel at N = 8k / 16k (H100)",
                            tma=True, persistent=True, wg_epilogue=True),
}


def fp8_forward_tile(hd: int, causal: bool) -> HopperTile:
    """The e4m3 forward's tile for a head-dim bucket without a window or packed sequences."""
    return HOPPER_FP8_FORWARD_PERSISTENT.get((hd, bool(causal)), HOPPER_FP8_FORWARD_TILES[hd])


def fp8_head_dim(d: int) -> int:
    """The e4m3 kernel's head-dim bucket: the smallest of FP8_HEAD_DIMS >= d (d <= 64 runs the
    128 kernel on zero-filled columns)."""
    for hd in FP8_HEAD_DIMS:
        if d <= hd:
            return hd
    raise ValueError(f"q: head dim {d} is larger than the largest supported, {FP8_HEAD_DIMS[-1]}")


@dataclass(frozen=True)
class PersistentRule:
    """When the persistent TMA kernel (one block per SM walking the query tiles, the next tile's
    loads overlapping this one's end) replaces the table tile: while a query tile's mean number of
    key tiles (visible pairs / rows / block_n) is at most max_key_tiles (None: any) - short
    sequences, where a fresh block per tile leaves its prologue and epilogue exposed - for the
    masks named: "any", "causal" (only under a causal mask) or "full" (only without one)."""

    tile: HopperTile
    max_key_tiles: int | None
    reason: str
    masks: str = "any"

    def for_mask(self, causal: bool) -> bool:
        """Whether the rule is one for problems with (causal) or without a causal mask."""
        return self.masks == "any" or (self.masks == "causal") == causal


# The first rule that matches a problem wins. Measured on the H200 (x = cuDNN ms / ours, bf16).
_PERSIST_64 = HopperTile(128, 2, 2, "128x128 ping-pong, persistent, per-warpgroup epilogue", tma=True, pingpong=True,
                         persistent=True, wg_epilogue=True)
_PERSIST_64_WG3 = HopperTile(128, 3, 3, "192x128, 3 math warpgroups taking turns, 3 stages, persistent, per-warpgroup "
                             "epilogue", tma=True, pingpong=True, persistent=True, wg_epilogue=True)
HOPPER_FORWARD_PERSISTENT: dict[int, tuple[PersistentRule, ...]] = {
    64: (PersistentRule(_PERSIST_64, 8, "causal N=1k/2k 0.92/0.94x against 0.85/0.92x for the 3-warpgroup persistent "
                        "tile and 0.80/0.93x for the table's (two runs)", "causal"),
         PersistentRule(_PERSIST_64_WG3, 16, "causal N=4k 1.05x against the table's 1.01x; at 8k / 16k the table's "
                        "is ahead (1.10 vs 1.09x, 1.13-1.15 vs 1.09-1.11x)", "causal"),
         PersistentRule(_PERSIST_64_WG3, None, "full N=1k/2k/4k/8k/16k 0.96/1.06-1.08/1.08-1.09/1.13-1.14/1.10-1.14x "
                        "against 0.94 (128x128 persistent)/1.01/1.05/1.11-1.12/1.09-1.14x for the table's", "full")),
    128: (PersistentRule(HopperTile(128, 2, 2, "128x128 own pace, persistent, per-warpgroup epilogue", tma=True,
                                    persistent=True, wg_epilogue=True), 16,
                         "causal N=1k/2k/4k 1.01/1.01/1.02x vs 0.88/0.94/0.99x, full N=1k/2k 0.93/0.95x vs 0.88/0.94x; "
                         "per-warpgroup epilogue, own pace: full N=1k/2k 0.97/0.98x, causal 1.03/1.05x; "
                         "beyond, the table tile (full N=4k/16k 0.98/0.97x vs 0.97/0.94x, causal 16k 1.07x vs 1.02x)"),),
}


# The score-modifier forward takes the plain kernel's persistent tile (attn_fwd_wgmma_tma_persistent_mod)
# only at these head dims and while a row sees at most (without a mask, causal) key tiles on
# average; elsewhere the table's per-tile kernel. H100, one process, the persistent against the
# per-tile kernel (softcap / ALiBi / sinks, d = 128, 16 heads, B.N = 16k): N = 1k 1.10 / 1.09 / 1.11x,
# causal 1.16 / 1.07 / 1.16x; 2k (16 tiles) 1.05 / 1.02 / 1.03x, causal (8) 1.09 / 0.99 / 1.06x; but causal
# 4k (16) 1.00 / 0.90 / 0.98x, and d = 64's 3-warpgroup tile 0.91-1.01x (N = 4k, 16k).
HOPPER_MOD_PERSISTENT_MAX_KEY_TILES: dict[int, tuple[int, int]] = {128: (16, 8)}


def persistent_rule(hd: int, causal: bool, mean_keys: int) -> PersistentRule | None:
    """The first of HOPPER_FORWARD_PERSISTENT[hd]'s rules for this mask whose bound the mean
    visible keys per row (whole keys) meet, or None."""
    for rule in HOPPER_FORWARD_PERSISTENT.get(hd, ()):
        if not rule.for_mask(causal):
            continue
        if rule.max_key_tiles is None or mean_keys <= rule.max_key_tiles * rule.tile.block_n:
            return rule
    return None


@dataclass(frozen=True)
class LongRowsRule:
    """When a longer key tile replaces the table tile: while a row's mean number of visible keys
    is at least min_keys - long rows, where fewer, longer steps pay each step's fixed waiting (the
    ring's barriers, the wgmma's own latency, the turn of the softmax) less often, and the longer
    fill before the first P V is spread over many steps."""

    tile: HopperTile
    min_keys: int
    reason: str


# Measured on the H200 (twice in one call, x = cuDNN ms / ours, the table's 128-key tile -> 192):
# full N=8k/16k 0.99/0.97 -> 1.02/1.00 (fp16 16k 0.95 -> 0.97), causal N=8k/16k 1.06/1.07 ->
# 1.08/1.10 (fp16 16k 1.07 -> 1.11); N=4k ties (full 0.98/0.98, causal 1.02/1.02); N=2k loses 2-3%
# (0.94 -> 0.92).
HOPPER_FORWARD_LONG_ROWS: dict[int, LongRowsRule] = {
    128: LongRowsRule(HopperTile(192, 2, 2, "128x192, 2 stages = 225 KiB (S 96 + O 64 + P 48 regs of 240)", tma=True),
                      4096, "mean visible keys per row >= 4096: +2-3% at N >= 8k, N=4k ties, N=2k -2-3%"),
}


# The key split (attn_fwd_wgmma_tma_split, full attention on the per-tile TMA kernel): with one
# block per SM, a grid of fewer query tiles than SMs leaves most SMs idle; each tile then runs as
# `splits` key ranges, merged by its last piece (H200: one head of N=8k at d=128 1.00 -> 1.60x
# cuDNN, at d=64 0.77 -> 1.70x).
# Splitting only the last partial wave of a longer grid (whose idle SMs cost cuflash and cuDNN alike
# ~2-3%) lost: in one kernel the piece bounds slowed every tile's loop by 2-4% (ptxas scheduled it
# differently); as a second launch after the whole tiles, the launch boundary and the first kernel's
# ragged end ate the gain (d=128 N=4k 0.981 -> 0.961x).
SPLIT_MAX = 6  # pieces per tile (each before the last writes a float32 partial O)
SPLIT_MIN_KEY_TILES = 8  # a piece's start and end (~2.7 us at d=128) stay small next to its loop
SPLIT_MAX_SPAN = 0.85  # split only if the grid then takes at most this many tile times
SPLIT_HEAD_DIMS = (64, 128, 192)  # d=256: the split's extra live values spill 260 bytes (O is 128 regs)


def key_splits(tiles: int, slots: int, key_tiles: int):
    """Pieces per query tile for a grid of `tiles` query tiles (fewer than the `slots` blocks that
    run at once) with `key_tiles` key tiles each, or None. k pieces per tile take ceil(k tiles /
    slots) rounds of 1/k tile time; the k with the fewest tile times wins (the smaller on ties), if
    that is at most SPLIT_MAX_SPAN and every piece keeps SPLIT_MIN_KEY_TILES."""
    if not 0 < tiles < slots:
        return None
    best_k, best = 1, 1.0
    for k in range(2, SPLIT_MAX + 1):
        if key_tiles // k < SPLIT_MIN_KEY_TILES:
            break
        span = -(-k * tiles // slots) / k
        if span < best - 1e-9:
            best_k, best = k, span
    return best_k if best_k > 1 and best <= SPLIT_MAX_SPAN else None


# The cp.async wgmma kernel (attn_fwd_wgmma): its band instantiation (windows, packed sequences,
# which TMA boxes would read across), and plain problems whose rows TMA cannot address (a base or
# stride not a multiple of 16 bytes) or without cuda-bindings.
HOPPER_FORWARD_CP_ASYNC_TILES: dict[int, HopperTile] = {
    64: HopperTile(64, 2, 2, "schedule search (H200): 64-key tiles at 122 regs let 2 blocks share an SM (16 warps); 6-27% faster than the largest legal tile, 192x128 wg3 s5 (1 block, 12 warps), at every N 1k-16k"),
    128: HopperTile(128, 2, 3, "S 64 + O 64 + P 32 regs per thread: 2 warpgroups at ~235 regs; 3 stages (K two tiles ahead) = 225 KiB, the most that fits; the schedule search found no faster legal tile"),
    192: HopperTile(64, 2, 2, "O is 96 regs: 64-key tiles keep S at 32; 2 stages = 145 KiB"),
    256: HopperTile(64, 2, 2, "O is 128 regs: 64-key tiles keep S at 32 (96 keys spill); 2 stages = 193 KiB"),
}


@dataclass(frozen=True)
class HopperBwdTile:
    """attn_bwd_kv_wgmma: each warpgroup owns 64 key rows, so block_n = 64 x warpgroups."""

    block_m: int  # queries per step: 64, or 64 x warpgroups (dQ then split by query rows)
    warpgroups: int
    reason: str
    tma: bool = False  # Q and dO tiles by TMA (attn_bwd_kv_wgmma_tma), issued by one thread
    # (TMA, atomic dQ) warp-specialized: a producer warpgroup loads and adds dQ by bulk reduce-adds
    # into a fragment-order accumulator (attn_bwd_kv_wgmma_ws); deterministic runs the TMA kernel
    ws: bool = False
    # (ws) at most one block per SM, each walking (key tile, K/V head, batch entry) units, so a
    # block's start (K/V load, ring fill) and end (dK/dV store) overlap the next unit's loads
    persistent: bool = False
    # (ws) lse and D copied by the math warpgroups a step ahead instead of by the producer's warp
    # (persistent: always)
    math_stats: bool = False
    # the warpgroups split dK/dV's columns instead of the keys (HopperBwdTraits::kSplitD, head dims
    # above 128, where 64 keys x all columns of dK and dV outgrow a thread's registers): block_n = 64
    split_d: bool = False

    @property
    def block_n(self) -> int:
        return 64 if self.split_d else 64 * self.warpgroups

    def frag_dq(self, deterministic: bool) -> bool:
        """Whether the kernel adds dQ by bulk reduce-adds of 64 x 64 fragment-order chunks (its
        accumulator then in that order, attn_bwd_dq_convert<..., true>): the warp-specialized
        kernel's dQ tiles, or a split head dim's dQ staged in the step's Q/dO tiles (TMA)."""
        return not deterministic and (self.ws or (self.split_d and self.tma))

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.ws)

    def smem_bytes(self, head_dim: int) -> int:
        """K, V, two Q and two dO buffers, the dS^T tile, 2 x (lse, D) rows, (TMA) two mbarriers,
        (ws) what HopperBwdTraits adds, + 1 KiB alignment."""
        # (ws) + 2 mbarriers, alignment, the dQ tiles, (dQ by rows) dS^T's second buffer
        ds2 = self.block_n * self.block_m * 2 if self.block_m == 64 * self.warpgroups else 0
        ws = 16 + 96 + 64 * 64 * 4 * self.warpgroups + ds2 if self.ws else 0
        # (split_d) + P^T's tile (HopperBwdTraits::kSplitS)
        return ((2 * self.block_n + 4 * self.block_m) * head_dim * 2 + (1 + self.split_d) * self.block_n * self.block_m * 2
                + 16 * self.block_m
                + 16 * self.tma + ws + 1024)


# Backward main kernel on Hopper (sm_90a), 16-bit inputs with 16-byte loads. Keyed by padded head
# dim; others use BACKWARD_TILES. The deterministic dQ kernel stays the mma.sync one. Rows TMA
# cannot address (or no cuda-bindings) run the same tile with cp.async loads (tma=False).
HOPPER_BACKWARD_TILES: dict[int, HopperBwdTile] = {
    64: HopperBwdTile(128, 2, "128 queries per step in two 64-query halves: dQ split by query rows (one atomic per element; with 64-query steps the split is by keys, two atomics per element, and atomics were ~45% of the kernel); Q/dO by TMA: 3-6% faster than cp.async (H200)", tma=True),
    128: HopperBwdTile(64, 2, "dK+dV 128 regs + S^T/dP^T 64 fit ~240 at 256 threads; dQ split by 64-column blocks, one per warpgroup; Q/dO by TMA: 5-9% faster than cp.async (H200)", tma=True),
    192: HopperBwdTile(64, 2, "the d=256 tile's kernel (HOPPER_BACKWARD_KERNEL_HD): 4/3 of the tensor work, against the mma.sync kernels at about a third of its speed", tma=True, split_d=True),
    256: HopperBwdTile(64, 2, "64 keys; each warpgroup 128 of dK/dV's columns (128 regs, as at d=128) and S^T/dP^T of 32 of the step's 64 queries, P^T and dS^T through shared memory (not all 64 computed twice); dQ by 128-column halves, staged in the step's Q/dO tiles and added by bulk reduce-adds (not one atomic per element pair); 215 KiB, no warp specialization (no room for a producer's ring); docs/decisions.md has the A/B", tma=True, split_d=True),
}

# Buckets whose Hopper backward runs a kernel for a wider head dim: splitting dK/dV's columns
# between two warpgroups (HopperBwdTraits::kSplitD) needs whole 64-column blocks per warpgroup,
# which 192 columns are not, so heads of 129-192 run the 256 kernel with the columns past d
# zero-filled by the copy engine and dropped on store. Its dQ accumulator rows are then 256 wide.
HOPPER_BACKWARD_KERNEL_HD: dict[int, int] = {192: 256}


def hopper_backward_head_dim(hd: int) -> int:
    """HEAD_DIM of the wgmma backward kernel that runs bucket hd."""
    return HOPPER_BACKWARD_KERNEL_HD.get(hd, hd)


def dq_accumulator_width(hd: int, hopper_atomic: bool) -> int:
    """Floats per row of the backward's dQ accumulator: the bucket, or where the wgmma K/V kernel
    adds dQ itself (not deterministic), that kernel's HEAD_DIM."""
    return hopper_backward_head_dim(hd) if hopper_atomic else hd


@dataclass(frozen=True)
class WsRule:
    """Where the warp-specialized backward (HopperBwdTile.ws) replaces the table tile's TMA kernel."""

    full: bool
    causal: bool
    reason: str


# Measured on the H200 (bf16, N = 1k / 4k / 16k, x = cuDNN ms / ours). The producer's rolled loops
# (BWD_FOR_EACH_STEP) took d=64 full from 0.64/0.67/0.72x to the figures below.
HOPPER_BACKWARD_WS: dict[int, WsRule] = {
    64: WsRule(True, True, "full 0.77/0.88/0.95x vs 0.71/0.73/0.78x for the TMA kernel, causal 0.71/0.78/0.83x "
                           "vs 0.74/0.76/0.78x; with dS^T double-buffered (N = 4k / 16k) full "
                           "0.91/0.97x, causal 0.81/0.88x"),
    128: WsRule(True, True, "full 0.82/0.92/0.96x vs 0.70/0.70/0.76x, causal 0.72/0.84/0.90x vs 0.69/0.70/0.75x"),
}


def hopper_backward_tile(hd: int, causal: bool) -> HopperBwdTile:
    """The wgmma backward's default tile: the table's, warp-specialized where HOPPER_BACKWARD_WS says."""
    t = HOPPER_BACKWARD_TILES[hd]
    rule = HOPPER_BACKWARD_WS.get(hd)
    use_ws = rule is not None and (rule.causal if causal else rule.full)
    return replace(t, ws=True) if use_ws else t


def dq_accumulator_floats(batch: int, hq: int, nq: int, hd: int, frag: bool) -> int:
    """Floats of the backward's dQ accumulator: rows x the head-dim bucket; the warp-specialized
    kernel's (fragment order, 64 x 64 chunks) pads each head's Nq up to a multiple of 64."""
    rows = -(-nq // 64) * 64 if frag else nq
    return batch * hq * rows * hd


def head_dim_bucket(d: int) -> int:
    for hd in HEAD_DIM_BUCKETS:
        if d <= hd:
            return hd
    raise ValueError(f"q: head dim {d} is larger than the largest supported, {MAX_HEAD_DIM}")


def forward_tile(d: int, vec: bool = True) -> tuple[int, TileConfig]:
    hd = head_dim_bucket(d)
    return hd, (FORWARD_TILES if vec else FORWARD_TILES_SCALAR)[hd]


def cpu_blocks(d: int) -> tuple[int, int]:
    """(block_m, block_n) the NumPy backend uses: the forward kernel's tile for this head dim."""
    _, cfg = forward_tile(min(max(d, 1), MAX_HEAD_DIM))
    return cfg.block_m, cfg.block_n


@dataclass(frozen=True)
class BackwardTile:
    block_m: int  # queries per inner tile (streamed)
    block_n: int  # keys owned by one block (dK, dV stay in registers)
    warps: int
    warps_d: int  # warps splitting the head dim of dK/dV (S and dP are recomputed per split)
    dq_block_m: int  # deterministic dQ kernel: query rows per block
    dq_block_n: int  # deterministic dQ kernel: keys per tile
    dq_warps: int
    dq_split: int  # deterministic dQ kernel: blocks splitting dQ's columns (each recomputes S, dP)
    reason: str

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        tile_q, tile_kv = self.block_m * head_dim, self.block_n * head_dim
        return (2 * tile_kv + 4 * tile_q + self.block_n * self.block_m) * 2 + 4 * self.block_m * 4

    def dq_smem_bytes(self, head_dim: int) -> int:
        return (2 * self.dq_block_m + 4 * self.dq_block_n) * head_dim * 2


# Backward, 16-bit inputs. Keys are the mma M dimension: each warp owns block_n / (warps / warps_d)
# key rows of dK and dV in registers (2 x rows x d/warps_d floats per warp).
BACKWARD_TILES: dict[int, BackwardTile] = {
    32: BackwardTile(64, 128, 8, 1, 64, 32, 4, 1, "dK+dV are 32 regs; 128 keys per block amortize the Q/dO stream"),
    64: BackwardTile(64, 128, 8, 1, 64, 64, 4, 1, "dK+dV are 64 regs/thread at 16 key rows per warp"),
    128: BackwardTile(32, 128, 8, 1, 64, 32, 4, 1, "dK+dV = 128 regs at 16 key rows per warp; 64-query tiles spill, so 32"),
    192: BackwardTile(32, 64, 8, 2, 64, 16, 4, 2, "two warps split d (96 columns each) so dK+dV fit; S/dP computed twice"),
    256: BackwardTile(32, 32, 8, 4, 64, 16, 4, 2, "four warps split d (64 columns each); S/dP computed 4x: correct, slow (no spill-free 2-way split found)"),
}


def backward_tile(d: int) -> tuple[int, BackwardTile]:
    hd = head_dim_bucket(d)
    return hd, BACKWARD_TILES[hd]


@dataclass(frozen=True)
class DecodeTile:
    block_n: int  # keys per warp tile
    warps: int  # warps per block, each streaming its own interleaved key tiles
    stages: int  # tiles in flight per warp
    max_row_tiles: int  # packed (GQA head, token) rows per block, in 16-row mma tiles
    reason: str
    # 0: each warp streams its own key tiles through a private ring (no block barrier in the loop);
    # 1: the block copies each step's warps x block_n keys of K and V together into one ring (a
    # barrier per step); 2: the same ring, K a step ahead from the step's start and V from its
    # softmax (FA2's order, two barriers per step). The same keys per warp in every mode. 3: the
    # block ring of 1, but warp w computes row tile w over all of a step's keys (wide rows: one K/V
    # head with many query heads; max_row_tiles <= warps, no cluster merge). 4: the rows of 3 with
    # FA2's copies, one K and one V buffer of a step each (stages 1): V_t copies under Q K_t^T, K_{t+1}
    # under P V_t.
    ring: int = 0
    # At most this many blocks per SM (0: as many as fit): the launch asks for more shared memory
    # than max_blocks_per_sm + 1 blocks could share on an H200 SM (device_limits.H200).
    max_blocks_per_sm: int = 0
    # Bytes per K/V element in the rings: 2 (q's 16-bit type) or 1 (an e4m3 cache: attn_decode_kv8).
    kv_bytes: int = 2

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def buffer_bytes(self, head_dim: int, row_tiles: int) -> int:
        """Q's packed rows (16-bit) and the K/V rings: the shared memory a block's merge may reuse."""
        return 16 * row_tiles * head_dim * 2 + self.warps * 2 * self.stages * self.block_n * head_dim * self.kv_bytes

    def smem_bytes(self, head_dim: int, row_tiles: int) -> int:
        need = self.buffer_bytes(head_dim, row_tiles) + self.warps * 16 * row_tiles * 2 * 4  # + the row statistics
        if self.max_blocks_per_sm:
            # one byte more than max_blocks_per_sm + 1 blocks' equal share (with the driver's reservation)
            floor = H200.smem_per_sm // (self.max_blocks_per_sm + 1) - H200.smem_reserved_per_block + 1
            need = max(need, -(-floor // 128) * 128)
        return need


# Split-KV decoding (few query tokens, long cache): memory bound, so the tile is sized for bytes in
# flight (each warp keeps one K+V tile loading while it computes another: warps x 2 x block_n x d
# x 2 bytes per SM) rather than for reuse. O is row_tiles x d / 8 x 4 registers per thread.
DECODE_TILES: dict[int, DecodeTile] = {
    32: DecodeTile(64, 4, 2, 4, "short rows: 64-key tiles keep 32 KiB per block in flight"),
    64: DecodeTile(32, 4, 2, 4, "32-key tiles: 32 KiB per block in flight; up to 64 packed rows"),
    128: DecodeTile(16, 4, 2, 2, "16-key tiles: 70 KiB of shared memory lets 3 blocks share an SM; with few (sequence, head) blocks, best with 2 waves of splits (H200: 2.9-4.4 TB/s after the in-order warp merge, vs 2.3-4.0 with 32-key tiles)"),
    192: DecodeTile(16, 4, 2, 1, "16-key tiles keep shared memory under the limit; 16 packed rows"),
    256: DecodeTile(16, 4, 2, 1, "16-key tiles keep shared memory under the limit; 16 packed rows"),
}


@dataclass(frozen=True)
class DecodeTmaTile:
    """attn_decode_tma: one producer warp fills a block-wide ring by TMA; consumer warps compute
    16 keys each of every 16 * consumer_warps-key stage."""

    consumer_warps: int
    stages: int  # ring depth: stages - 1 of them in flight while one is consumed
    max_row_tiles: int
    reason: str
    waves: int = 1  # splits aim at waves x (blocks that fit one per SM)

    @property
    def threads(self) -> int:
        return 32 * (self.consumer_warps + 1)

    @property
    def stage_keys(self) -> int:
        return 16 * self.consumer_warps

    @property
    def warps(self) -> int:  # the warps that split the keys (num_splits sizes splits by them)
        return self.consumer_warps

    @property
    def block_n(self) -> int:
        return 16

    def smem_bytes(self, head_dim: int, row_tiles: int) -> int:
        rows = 16 * row_tiles
        ring = self.stages * 2 * self.stage_keys * head_dim * 2
        return ring + rows * head_dim * 2 + self.consumer_warps * rows * 2 * 4 + 2 * self.stages * 8 + 1024


# Hopper decode (TMA ring), head dims whose rows are whole 128-byte boxes. Sized for bytes in
# flight per SM: (stages - 1) x 2 x stage_keys x d x 2 bytes per block.
DECODE_TMA_TILES: dict[int, DecodeTmaTile] = {
    64: DecodeTmaTile(4, 8, 4, "8 x 16 KiB stages: 112 KiB in flight per block"),
    128: DecodeTmaTile(4, 6, 2, "6 x 32 KiB stages: 160 KiB in flight per block, one block per SM"),
}


# With at least one (sequence, K/V head) block per SM no split is needed. The tile: 2-stage rings in
# FA2's order (ring 2), at most two blocks per SM (its 70 KiB would let three share an SM, and a
# third pair's streams cost 12%: 283 vs 248 us at B=64 Hkv=8 L=4k). Decode kernel alone on the
# H200, three passes each, TB/s against the tiles it replaces:
#   B=8 Hkv=32 (1.9 blocks per SM; was 16x4 s3): 4k 4.25-4.27 -> 4.30-4.32, 16k 4.47 -> 4.49,
#     64k 4.54-4.55 -> 4.58 (cuDNN 4.24-4.26 / 4.49-4.50 / 4.58);
#   B=64 Hkv=8 (3.9 per SM; was one 8-warp 16x8 s2 block per SM, which had beaten 16x4 s3 by 2%
#     at 16k / 64k): 4k 4.29-4.34 -> 4.38-4.39, 16k 4.53-4.54 ->
#     4.54-4.55, 64k 4.58 -> 4.58-4.59 (cuDNN 4.39-4.40 / 4.50-4.52 / 4.52-4.53).
DECODE_TILES_NO_SPLIT: dict[int, DecodeTile] = {
    128: DecodeTile(16, 4, 2, 2, "a (sequence, head) block for every SM: no split, 2-stage rings in FA2's order, "
                    "two blocks per SM", ring=2, max_blocks_per_sm=2),
}

# Wide heads with fewer (sequence, K/V head) pairs than SMs: 2-warp blocks. The table's 4-warp
# tile takes 137 KiB at d=256 (102 KiB at d=192), so one block (two) per SM and 1.9 rounds of
# splits; 2 warps take 72 KiB (54 KiB), three (four) blocks per SM. H200, bf16 Hq=32 Hkv=8, us
# through the planner before -> after, FlashAttention-2 (the fastest peer there) in brackets:
#   d=256 B=8 L=4k 94.4 -> 74.0 (75.2), L=16k 312.8 -> 265.1 (252.5), B=1 L=64k 163.8 -> 152.6
#   (152.8), B=2 L=32k 182.7 -> 142.0 (149.2); d=192 B=8 L=16k 242.6 -> 209.1 (199.7).
# With a pair for every SM the table's tile stays (B=64 L=4k d=256: 2 warps 588.7 vs 489.8 us).
DECODE_TILES_FEW_PAIRS: dict[int, DecodeTile] = {
    192: DecodeTile(16, 2, 2, 1, "fewer pairs than SMs: 2-warp blocks, four per SM"),
    256: DecodeTile(16, 2, 2, 1, "fewer pairs than SMs: 2-warp blocks, three per SM"),
}
# 4 splits of more than 3072 keys merge through memory, not in a cluster. There, at d=192, the
# table's 4-warp tile (two blocks per SM) is ahead again; in a cluster the 2-warp blocks stay far
# ahead; at d=256 the two tie through memory. H200, Hq=32 Hkv=8, x the faster peer (FA2), three
# passes, 2 warps -> 4 warps: d=192 B=1 L=64k 1.13 -> 1.20, B=2 L=32k 1.08 -> 1.16, B=4 L=16k 1.07
# -> 1.14, B=8 L=16k 0.98 -> 1.05, L=64k 0.98 -> 1.03; in a 4-block cluster (B=8 L=4k) 1.02 -> 0.88;
# d=256 through memory 0.99-1.12 either way (within 0.5%), in a cluster 1.01 -> 0.79.
# So at these head dims the 2-warp tile runs only where the table tile's splits would merge in a cluster.
DECODE_FEW_PAIRS_CLUSTERS_ONLY = frozenset({192})

# Splits merged through memory (longer than plan.decode.CLUSTER_MAX_CHUNK keys each): the table's
# tile in FA2's order. Decode kernel alone, four passes, B=8 Hkv=8 L=64k (4 splits of 16k keys):
# 4.43-4.44 -> 4.46-4.47 TB/s; at 4k / 16k (cluster merge, 1k / 4k keys per split) ring 2 was 0.5-1%
# slower.
# (No block cap: the 4-block clusters need the third block slot of an SM.)
DECODE_TILES_LONG_SPLITS: dict[int, DecodeTile] = {
    128: DecodeTile(16, 4, 2, 2, "splits of more than CLUSTER_MAX_CHUNK keys: the table's tile in FA2's order",
                    ring=2),
}

# Cluster-merged splits of at least plan.decode.CLUSTER_RING_MIN_CHUNK keys: the table's tile with
# the block copying each step's K and V together (ring 1). Decode kernel alone, three alternating
# passes, B=8 Hkv=8 (4 splits in a cluster): L=8k (2k keys per split) 3.87-3.89 -> 3.92-3.94 TB/s,
# L=16k (4k per split) 4.16-4.17 -> 4.19-4.21 (cuDNN 4.19-4.21); at L=4k (1k per split) ring 0 stays
# ahead (3.45-3.57 vs 3.44-3.48).
DECODE_TILES_LONG_CLUSTER_SPLITS: dict[int, DecodeTile] = {
    128: DecodeTile(16, 4, 2, 2, "cluster-merged splits of 2k-4k keys: one block-wide K+V copy per step", ring=1),
}


# One K/V head with many query heads (MQA, Hq >= 48): a block of up to 64 packed rows whose warps
# each own a row tile and share every K/V tile of the block ring (FlashAttention's forward order),
# where the table's blocks have each warp walk its own keys for all rows, and more rows than a block
# holds run as row blocks that each read the K/V head. FA2 reads MQA this way and led there
# (0.62-0.94x of it). The planner takes it for more than 32 packed rows per K/V head unless the
# splits are short (plan.decode.planner_tile): x the faster peer, table -> wide, d=128 Hq=64 B=8
# L=32k 0.82 -> 0.91, B=64 L=16k 0.62 -> 0.87, Hq=128 B=16 L=8k 0.77 -> 0.92; d=64 Hq=64 B=16 L=16k
# 0.81 -> 1.00, Hq=128 B=64 L=16k 0.67 -> 0.91; GQA nq=16 (64 rows) B=8 Hq=32 Hkv=8 d=128 L=4k 1.77
# -> 1.96.
DECODE_TILES_WIDE_ROWS: dict[int, DecodeTile] = {
    64: DecodeTile(32, 4, 2, 4, "wide rows: a row tile per warp, 128-key steps shared by the block", ring=3),
    128: DecodeTile(16, 4, 2, 4, "wide rows: a row tile per warp, 64-key steps shared by the block", ring=3),
}
# With plan.decode.WIDE_LONG_AUTO (on; tests turn it off) the planner's wide-rows blocks of four
# row tiles (64 packed rows) with splits of at least WIDE_LONG_MIN_CHUNK keys take ring 4 instead:
# FA2's copies, one K and one V buffer of 128-key steps (the same shared memory as ring 3's two
# stages of 64 keys; 236-255 registers, two blocks per SM). H200, two passes, x the faster peer
# (FA2), ring 3 -> 4: Hq=64 B=8 L=32k 0.96 -> 1.02, B=32 L=16k 1.01 -> 1.02, B=64 L=16k 0.91 ->
# 0.94, Hq=128 B=16 L=8k 0.98 -> 1.02; not with three row tiles (Hq=48 B=16 L=8k 0.97 / 0.96),
# short splits (B=4 Hq=64 L=16k 0.955 / 0.95 at 256-512 keys, B=2 Hq=48 L=32k 0.99 / 0.97), B=1
# L=128k (512 keys: 1.11 either way); nq=16 Hq=32 Hkv=8 L=4k 2.08 / 2.07 (1024 keys: taken with
# the rule). Through the API (off -> on in alternating processes, two passes, x FA2): Hq=64 B=8
# L=32k 0.96 -> 1.02, B=64 L=16k 0.91 -> 0.93, Hq=128 B=16 L=8k 0.97 -> 1.01; d=64 unchanged. A
# d=64 ring-4 tile (128-key steps, 168 registers) lost to ring 3 at every d=64 shape measured
# (0.87-0.99 against 0.94-1.19).
DECODE_TILES_WIDE_ROWS_LONG: dict[int, DecodeTile] = {
    128: DecodeTile(32, 4, 1, 4, "wide rows in FA2's order: one K and one V buffer of 128-key steps", ring=4),
}
WIDE_LONG_MIN_CHUNK = 768  # (between the splits measured: 256-512 keys stay on ring 3, 1008-4096 take ring 4)


# An e4m3 K/V cache (attn_decode_kv8, cuda_src/kv_e4m3.cuh). d=128: 32-key tiles in two stages,
# the block copying each step's K and V together (ring 1), where a key tile is half the 16-bit
# tile's bytes. H100, the cache read over the copy rate of the same run, one-token decode, Hq=32,
# the 16-bit tile with doubled stages (16 x 4 warps, 4 stages, ring 0) -> this tile: B=8 Hkv=8
# L=16k 0.889 -> 0.922, L=64k 0.973 -> 1.007, B=64 L=16k 0.786 -> 1.040, B=8 Hkv=32 L=16k 0.772 ->
# 1.013, B=1 Hkv=8 L=128k 0.785 -> 0.890 (plan.decode.e4m3_launch: two waves of splits).
# Of ten tiles (16-64 keys, 4 or 8 warps, 2-8 stages, rings 0-2) it was first or within 0.3% of
# the first in every cell; ring 2 (FA2's order) ties it at 16k-64k with Hkv=8 and loses 17-20%
# with B=64 or Hkv=32. d=64 and d=256 (not measured): the 16-bit tile's bytes in flight, with
# twice the stages.
DECODE_TILES_KV8: dict[int, DecodeTile] = {
    64: DecodeTile(32, 4, 4, 4, "e4m3 cache: the 16-bit tile's bytes in flight with 4 stages (not measured)",
                   kv_bytes=1),
    128: DecodeTile(32, 4, 2, 2, "e4m3 cache: 32-key tiles, 2 stages, one block-wide K+V copy per step: "
                    "0.89-1.04x the copy rate at L >= 16k (16x4 s4: 0.77-0.97x)", ring=1, kv_bytes=1),
    256: DecodeTile(16, 4, 4, 1, "e4m3 cache: the 16-bit tile's bytes in flight with 4 stages (not measured)",
                    kv_bytes=1),
}


def decode_tile(d: int) -> tuple[int, DecodeTile]:
    hd = head_dim_bucket(d)
    return hd, DECODE_TILES[hd]
