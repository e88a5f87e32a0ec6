// The split-KV decode block's pieces (attn_decode.cu's attn_decode_block): its traits, its first
// copies, a main loop per ring mode and its end (the warps' merge and the store, or the splits' merge). Every loop runs decode_tile_step (decode_common.cuh) over the block's keys; they differ
// in who copies K and V into shared memory and when:
//   RING 0     each warp its own key tiles through a private ring (no block barrier in the loop);
//   RING 1, 2  the block each step's WARPS x BLOCK_N keys into one shared ring, warp w computing the
//              step's tile w (1: K and V together after the step's barrier; 2: K there and V after
//              the softmax, FA2's order, two barriers per step);
//   RING 3     RING 1's copies, warp w computing row tile w over all of a step's keys (wide rows);
//   RING 4     RING 3's rows with one K and one V buffer of a step each (FA2's copies, STAGES 1).
// The same keys reach each warp in the same order in RING 0-2, so their results are the same bit for bit.
#pragma once
#include "common.cuh"
#include "softmax.cuh"
#include "decode_common.cuh"
#include "decode_loads.cuh"

// KV: KvSame or KvE4m3 (kv_e4m3.cuh): K/V rows of kKvCols 16-bit words (an e4m3 row's bytes in pairs).
template <int HEAD_DIM, int ROW_TILES, int BLOCK_N, int WARPS, int STAGES, typename KV = KvSame>
struct DecodeTraits {
    static constexpr int kHeadDim = HEAD_DIM, kRowTiles = ROW_TILES, kBlockN = BLOCK_N, kWarps = WARPS, kStages = STAGES;
    static constexpr int kRows = 16 * ROW_TILES;  // packed (head, token) rows, zero-padded
    static constexpr int kChunks = HEAD_DIM / 8;
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kKvCols = HEAD_DIM * KV::kBytes / 2;
    static constexpr int kTileKV = BLOCK_N * kKvCols;
    static constexpr int kRingElems = 2 * STAGES * kTileKV;  // one warp's K and V ring
    static constexpr int kRingBytes = WARPS * kRingElems * 2;  // all rings: the O merge's buffer at the end
    static constexpr int kStepN = WARPS * BLOCK_N, kStepTile = kStepN * kKvCols;  // one step of the block ring
    static constexpr int kSmemBytes =
        (kRows * HEAD_DIM + WARPS * kRingElems) * 2 + WARPS * kRows * 2 * 4;
    using Swz = Swizzle<HEAD_DIM>;
    static_assert((BLOCK_N * kChunks) % 32 == 0 && (BLOCK_N * kKvCols / 8) % 32 == 0, "a warp loads its tiles evenly");
};

// The copies in flight before the first step: RING 4 K_0 (V_0 copies at step 0's start); RING 1-3
// the block ring's first STAGES - 1 steps (RING 2: each step's K and V as two groups); RING 0 this
// warp's first STAGES - 1 tiles. One commit group per copy, empty past the keys, so the loops' waits
// count groups the same way at every length.
template <int RING, int STAGES, typename Loader>
__device__ __forceinline__ void decode_prefetch(const Loader& kv_load, int n_steps, int my_tiles) {
    if constexpr (RING == 4) {
        if (n_steps > 0) kv_load.step(0, 0, true, false);
        cp_async_commit();
    } else if constexpr (RING > 0) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_steps) kv_load.step(s, s, true, RING != 2);
            cp_async_commit();
            if constexpr (RING == 2) {
                if (s < n_steps) kv_load.step(s, s, false, true);
                cp_async_commit();
            }
        }
    } else {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < my_tiles) kv_load.warp_tile(s, s);
            cp_async_commit();
        }
    }
}

// RING 4: FA2's order with one K and one V buffer of a step each (the shared memory of RING 3's two
// stages of half the keys): V_t copies under Q K_t^T and the softmax, K_{t+1} under P V_t. Warps
// past ROW_TILES only copy.
template <typename T, typename Tr, bool CAUSAL, bool WINDOW, typename QA, typename Loader, typename Rows,
          typename Softmax, typename Acc, typename Mods>
__device__ __forceinline__ void decode_loop_fa2_rows(const QA& qa, const Loader& kv_load,
                                                     u32 sbase, int n_steps, int s0, int s1, const Rows& rows,
                                                     int lo0, int hi0, int nq, int warp, int lane, Softmax& softmax,
                                                     Acc& acc_o, float scale_log2, const Mods& mod) {
    constexpr int kHeadDim = Tr::kHeadDim;
    const u32 kbase = sbase + Tr::kRows * kHeadDim * 2;
    const LaneAddr<kHeadDim> aK(kbase, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<kHeadDim> aV(kbase + Tr::kStepTile * 2, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    for (int t = 0; t < n_steps; ++t) {
        cp_async_wait<0>();
        __syncthreads();  // K_t visible; every warp is past P V_{t-1}: V's buffer refills
        kv_load.step(t, 0, false, true);
        cp_async_commit();
        auto k_ahead = [&]() {
            cp_async_wait<0>();
            __syncthreads();  // V_t visible; every warp is past Q K_t^T: K's buffer refills
            if (t + 1 < n_steps) kv_load.step(t + 1, 0, true, false);
            cp_async_commit();
        };
        if (warp < Tr::kRowTiles)
            decode_tile_step<T, kHeadDim, 1, Tr::kStepN, CAUSAL, WINDOW>(qa, aK, aV, 0, 0, s0 + t * Tr::kStepN, s1, rows,
                                                                         lo0, hi0, nq, lane, softmax, acc_o,
                                                                         scale_log2, k_ahead, KvSame{}, mod);
        else
            k_ahead();  // (a warp without rows still meets the barrier and copies its share)
    }
}

// RING 1-3: the block ring of STAGES steps, each step's copies a barrier ahead (RING 2: V's after
// the softmax). RING 1-2: warp w computes the step's key tile w over all rows; RING 3 (kRowSplit):
// row tile w over all of the step's keys.
template <typename T, typename Tr, bool CAUSAL, bool WINDOW, int RING, typename KV, typename QA, typename Loader,
          typename Rows, typename Softmax, typename Acc, typename Mods>
__device__ __forceinline__ void decode_loop_block_ring(const QA& qa, const Loader& kv_load, u32 sbase, int n_steps,
                                                       int s0, int s1, const Rows& rows, int lo0, int hi0, int nq,
                                                       int warp, int lane, Softmax& softmax, Acc& acc_o,
                                                       float scale_log2, const KV& kv, const Mods& mod) {
    constexpr int kHeadDim = Tr::kHeadDim, kKvCols = Tr::kKvCols, kBlockN = Tr::kBlockN, kStages = Tr::kStages;
    constexpr int kRowTiles = Tr::kRowTiles;
    constexpr bool kE4m3 = KV::kE4m3, kRowSplit = RING >= 3;
    const u32 kbase = sbase + (Tr::kRows * kHeadDim + (kRowSplit ? 0 : warp * kBlockN * kKvCols)) * 2;
    // (e4m3: K read with V's lane pattern, kv_e4m3.cuh)
    const LaneAddr<kKvCols> aK(kbase, kE4m3 ? ((lane >> 3) & 1) * 8 + (lane & 7) : (lane >> 4) * 8 + (lane & 7),
                               kE4m3 ? lane >> 4 : (lane >> 3) & 1);
    const LaneAddr<kKvCols> aV(kbase + kStages * Tr::kStepTile * 2, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    // Groups after the one a wait needs: RING 1, the later steps' (STAGES - 2); RING 2, V_t
    // and the later steps' K and V (before Q K^T), or the later steps' and K_{t+STAGES-1} (before P V).
    constexpr int kAfter = RING != 2 ? kStages - 2 : 2 * kStages - 3;
    for (int t = 0; t < n_steps; ++t) {
        cp_async_wait<kAfter>();
        __syncthreads();  // step t's copies visible; every warp is past step t-1, whose slots refill
        const int next = t + kStages - 1, next_slot = next % kStages;
        if (next < n_steps) kv_load.step(next, next_slot, true, RING != 2);
        cp_async_commit();
        auto v_ahead = [&]() {
            if constexpr (RING == 2) {
                cp_async_wait<kAfter>();
                __syncthreads();  // V_t visible
                if (next < n_steps) kv_load.step(next, next_slot, false, true);
                cp_async_commit();
            }
        };
        const u32 slot = (t % kStages) * Tr::kStepTile * 2;
        if constexpr (kRowSplit) {  // the whole step's keys for this warp's row tile
            if (warp < kRowTiles)
                decode_tile_step<T, kHeadDim, 1, Tr::kStepN, CAUSAL, WINDOW>(qa, aK, aV, slot, slot, s0 + t * Tr::kStepN,
                                                                             s1, rows, lo0, hi0, nq, lane, softmax,
                                                                             acc_o, scale_log2, DecodeNoStep{}, KvSame{},
                                                                             mod);
        } else {
            const int n0 = s0 + t * Tr::kStepN + warp * kBlockN;
            if (n0 < s1)
                decode_tile_step<T, kHeadDim, kRowTiles, kBlockN, CAUSAL, WINDOW>(
                    qa, aK, aV, slot, slot, n0, s1, rows, lo0, hi0, nq, lane, softmax, acc_o, scale_log2, v_ahead, kv,
                    mod);
            else
                v_ahead();  // (a warp past the keys still meets the barrier and copies its share)
        }
    }
}

// RING 0: this warp's key tiles w, w + WARPS, ... through its private ring of STAGES tiles (a warp
// barrier per tile, none of the block's).
template <typename T, typename Tr, bool CAUSAL, bool WINDOW, typename KV, typename QA, typename Loader, typename Rows,
          typename Softmax, typename Acc, typename Mods>
__device__ __forceinline__ void decode_loop_warp_ring(const QA& qa, const Loader& kv_load, u32 sbase, int my_tiles,
                                                      int s0, int s1, const Rows& rows, int lo0, int hi0, int nq,
                                                      int warp, int lane, Softmax& softmax, Acc& acc_o,
                                                      float scale_log2, const KV& kv, const Mods& mod) {
    constexpr int kHeadDim = Tr::kHeadDim, kKvCols = Tr::kKvCols, kBlockN = Tr::kBlockN, kStages = Tr::kStages;
    constexpr int kRowTiles = Tr::kRowTiles, kWarps = Tr::kWarps;
    constexpr bool kE4m3 = KV::kE4m3;
    const u32 rbase = sbase + (Tr::kRows * kHeadDim + warp * Tr::kRingElems) * 2;
    const LaneAddr<kKvCols> aK(rbase, kE4m3 ? ((lane >> 3) & 1) * 8 + (lane & 7) : (lane >> 4) * 8 + (lane & 7),
                               kE4m3 ? lane >> 4 : (lane >> 3) & 1);
    const LaneAddr<kKvCols> aV(rbase + kStages * Tr::kTileKV * 2, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    for (int t = 0; t < my_tiles; ++t) {
        cp_async_wait<kStages - 2>();
        __syncwarp();  // every lane's copies of tile t are visible; everyone left tile t-1's slot
        if (t + kStages - 1 < my_tiles) kv_load.warp_tile(t + kStages - 1, (t + kStages - 1) % kStages);
        cp_async_commit();
        const u32 slot = (t % kStages) * Tr::kTileKV * 2;
        const int n0 = s0 + (t * kWarps + warp) * kBlockN;
        decode_tile_step<T, kHeadDim, kRowTiles, kBlockN, CAUSAL, WINDOW>(qa, aK, aV, slot, slot, n0, s1, rows, lo0, hi0,
                                                                          nq, lane, softmax, acc_o, scale_log2,
                                                                          DecodeNoStep{}, kv, mod);
    }
}

// The block's end: RING 3 / 4 (each warp's rows final) publish and store as one warp's; otherwise
// the warps merge their states (decode_merge_store, or decode_merge_warps then the cluster's merge
// through distributed shared memory with CLUSTER splits). With split_done, the last split of each
// (sequence, K/V head) then merges the partials (decode_last_split_merges; it stages them in Q's
// tile and the rings, free once this block's result is stored).
template <typename T, typename Tr, int CLUSTER, int RING, bool E4M3, typename Softmax, typename Acc>
__device__ __forceinline__ void decode_block_end(const Softmax& softmax, const Acc& acc_o, u16* smem, float* s_stat,
                                                 int warp, int lane, u16* __restrict__ o, float* __restrict__ lse,
                                                 float* __restrict__ part_o, float* __restrict__ part_lse,
                                                 int* __restrict__ split_done, i64 o_sb, i64 o_sh, i64 o_sn, int b,
                                                 int hk, int split, int n_splits, int hq, int nq, int d, int group,
                                                 float scale_log2) {
    constexpr int kHeadDim = Tr::kHeadDim, kRowTiles = Tr::kRowTiles, kWarps = Tr::kWarps, kRows = Tr::kRows;
    constexpr int kMergeBytes = kRows * kHeadDim * 2 + Tr::kRingBytes;
    float* sO = reinterpret_cast<float*>(smem + kRows * kHeadDim);  // the merge buffer reuses the rings
    if constexpr (RING >= 3) {
        decode_publish_row_tile<kHeadDim>(softmax, acc_o, warp < kRowTiles, s_stat, sO, warp, lane, group * nq);
        decode_store<T, kHeadDim, kRowTiles, 1, Tr::kThreads, 1, true>(s_stat, sO, o, lse, part_o, part_lse, o_sb, o_sh,
                                                                     o_sn, b, hk, gridDim.y, split, n_splits, hq, nq, d,
                                                                     group, scale_log2);
        if (split_done != nullptr && n_splits > 1)
            decode_last_split_merges<T, kHeadDim, kRowTiles, Tr::kThreads, kMergeBytes>(
                split_done, part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, gridDim.y, n_splits, hq, nq, d, group,
                reinterpret_cast<float*>(smem));
    } else if constexpr (CLUSTER == 0) {
        decode_merge_store<T, kHeadDim, kRowTiles, kWarps, Tr::kThreads, Tr::kRingBytes, E4M3>(
            softmax, acc_o, true, s_stat, sO, warp, lane, o, lse, part_o, part_lse, o_sb, o_sh, o_sn, b, hk, gridDim.y,
            split, n_splits, hq, nq, d, group, scale_log2);
        if (split_done != nullptr && n_splits > 1)
            decode_last_split_merges<T, kHeadDim, kRowTiles, Tr::kThreads, kMergeBytes>(
                split_done, part_o, part_lse, o, lse, o_sb, o_sh, o_sn, b, hk, gridDim.y, n_splits, hq, nq, d, group,
                reinterpret_cast<float*>(smem));
    } else {
#if __CUDA_ARCH__ >= 900
        constexpr int kSlots = decode_merge_slots<kHeadDim, kRowTiles, kWarps, Tr::kRingBytes>();
        decode_merge_warps<kHeadDim, kRowTiles, kWarps, kSlots, E4M3>(softmax, acc_o, true, s_stat, sO, warp, lane,
                                                                     group * nq, scale_log2);
        decode_cluster_store<T, kHeadDim, kRowTiles, kWarps, Tr::kThreads, CLUSTER, kSlots>(
            s_stat, sO, split, o, lse, o_sb, o_sh, o_sn, b, hk, hq, nq, d, group, scale_log2);
#endif
    }
}
