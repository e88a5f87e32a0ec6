// The Hopper backward's compile-time shape (HopperBwdTraits) and its run-time extras: the TMA
// kernels' tensor maps (BwdMaps) and the persistent kernel's work units (BwdUnits).
#pragma once
#include "common.cuh"
#include "wgmma.cuh"
#include "tma.cuh"

// The Q and dO tensor maps of attn_bwd_kv_wgmma_tma (parameter space); null for cp.async loads.
struct BwdMaps {
    const TmaDesc* q;
    const TmaDesc* dout;
    const TmaDesc* k = nullptr;  // (PERSISTENT) K and V, boxes of 64 columns x the block's keys
    const TmaDesc* v = nullptr;
};

// (PERSISTENT) the work units, counted on the host: kernel parameters are read from the constant
// bank where used, so the 24-register producer warps need not keep them (or their quotients) live.
struct BwdUnits {
    int kv_tiles = 1, hkv = 1, count = 1;  // key tiles, K/V heads, units = key tiles x K/V heads x batch
};

template <int HEAD_DIM, int BLOCK_M, int WARPGROUPS, bool TMA = false, bool WS = false>
struct HopperBwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;
    static constexpr int kBlockM = BLOCK_M;             // queries per step
    // (HEAD_DIM > 128) the warpgroups split dK and dV by columns instead of by keys: 64 key rows of
    // all 256 columns would be 256 accumulator registers per thread for dK and dV. So the block
    // owns 64 keys, each warpgroup HEAD_DIM / WARPGROUPS columns of their dK and dV; S^T and dP^T
    // are split between the warpgroups by queries (kSplitS below).
    static constexpr bool kSplitD = HEAD_DIM > 128;
    static constexpr int kBlockN = kSplitD ? 64 : 64 * WARPGROUPS;  // keys owned by the block
    static constexpr int kDkvCols = kSplitD ? HEAD_DIM / WARPGROUPS : HEAD_DIM;  // a warpgroup's dK/dV columns
    static constexpr int kThreads = 128 * WARPGROUPS;
    // (causal, one block per unit) the launch order: longest blocks first within groups of this
    // many (batch, head) pairs. Plain key tile order left the last heads' long blocks
    // running alone at the grid's end (SMs idle 3-6% of N=4k); across all heads, Q/dO and dQ
    // traffic outgrows L2 (d=64 N=4k 22% slower). H200 trace spans, key tile order / G = 4 / 16 /
    // all, N=4k:
    // d=64 1535 / 1512 / 1498 / 1876 us, d=128 1278 / 1220 / 1228 / 1330, d=256 2623 / 2521 /
    // 2534 / 2540; N=16k d=128 4532 / 4532 / 4613 / 4617.
    static constexpr int kLptHeads = 4;
    using TileQ = Sw128Tile<HEAD_DIM, BLOCK_M>;         // Q and dO, two buffers each
    using TileKV = Sw128Tile<HEAD_DIM, kBlockN>;
    using TileS = Sw128Tile<BLOCK_M, kBlockN>;          // dS^T: rows = keys, columns = queries
    static constexpr int kHalves = BLOCK_M / 64;        // 64-query sub-steps of S^T .. dK
    static constexpr bool kDqByRows = BLOCK_M == 64 * WARPGROUPS;
    static constexpr bool kDqByColumns = !kDqByRows && HEAD_DIM % (64 * WARPGROUPS) == 0;
    static constexpr bool kDqBlockSync = kDqByRows || kDqByColumns;  // reads other warpgroups' dS^T
    static constexpr int kDqCols = kDqByColumns ? HEAD_DIM / WARPGROUPS : HEAD_DIM;
    static constexpr int kDqKeys = kDqBlockSync ? kBlockN : 64;
    // (split head dim, TMA, atomic dQ) each warpgroup's 64 x HEAD_DIM / 2 float32 dQ is staged in
    // the step's Q and dO tiles' columns that only its own dK and dV still read (the 16 KiB of Q's
    // and of dO's 64-column blocks 2 wg, 2 wg + 1), in fragment order, and added by two bulk
    // reduce-adds instead of one red.global.add.v2 per element pair (no room for separate dQ tiles).
    static constexpr bool kDqStagedInQdO = kSplitD && TMA;
    // (split head dim) split S: each warpgroup computes S^T and dP^T for 32 of the step's 64 queries
    // only (not all 64 twice), stores P^T and dS^T to shared memory, and after one block barrier
    // takes dV += P^T dO and dK += dS^T Q with both operands from shared memory.
    static constexpr bool kSplitS = kSplitD;
    // (TMA) + 16: two "tile landed" mbarriers, one per Q/dO buffer; (WS) + 16: two "buffer free"
    // mbarriers, then each math warpgroup's 16 KiB dQ staging tile (128-byte aligned).
    static constexpr int kDqTileBytes = 64 * 64 * 4;
    // (WS, dQ by rows) dS^T double-buffered: a warpgroup writes step s + 1's while the other may
    // still read step s's for dQ, so the math warpgroups meet once per step (before dQ), not
    // twice: +1-3.5% at d=64 (H200), but 2.5-5% slower at d=128, N=16k (dQ by
    // columns), where the second meeting stays.
    static constexpr int kDsBuffers = WS && kDqByRows ? 2 : 1;
    static constexpr int kSmemBytes = 2 * TileKV::kBytes + 4 * TileQ::kBytes + (kDsBuffers + kSplitS) * TileS::kBytes + 4 * BLOCK_M * 4 +
                                      (TMA ? 16 : 0) + (WS ? 16 + 96 + WARPGROUPS * kDqTileBytes : 0) + 1024;
    static_assert(HEAD_DIM % 64 == 0 && BLOCK_M % 64 == 0, "128-byte swizzle atoms");
    static_assert(BLOCK_M == 64 || kDqByRows, "dQ = dS K takes one 64-row wgmma tile per warpgroup");
    static_assert(!kSplitD || (BLOCK_M == 64 && kDkvCols % 64 == 0 && kDqByColumns && !WS),
                  "split head dim: 64-query steps, whole 64-column blocks per warpgroup, dQ by columns, no WS");
};
