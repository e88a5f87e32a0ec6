// The split-KV decode kernel's K/V copies (attn_decode.cu): cp.async of one block's keys - its
// split of one (K/V head, sequence) - from the cache into shared memory, contiguous or paged.
#pragma once
#include "common.cuh"
#include "tile_load.cuh"

// One block's K/V copies, by mode: `step` (RING > 0, the block ring), `warp_tile` (RING 0, a warp's
// private ring), each through `page_group` where a block table pages the cache. K/V rows of KV_COLS
// 16-bit words in shared memory (an e4m3 row's bytes in pairs), kv_d of them read from the cache (the
// rest zero-filled); BLOCK_N-key tiles, WARPS warps, STAGES slots a ring. The cache's keys s0 ..
// s1 - 1 of K/V head hkv_head of sequence b (gK / gV: its rows, unpaged); keys at or past s1 are
// zero-filled. The destinations are the block's: `ring` this warp's K stages then V stages (RING 0),
// `ringK` / `ringV` the block ring's STAGES step slots of K and of V (RING > 0).
template <int KV_COLS, int BLOCK_N, int WARPS, int STAGES, bool VEC>
struct DecodeKvLoader {
    enum : int {
        kThreads = WARPS * 32,
        kTileKV = BLOCK_N * KV_COLS,  // one warp's tile
        kStepN = WARPS * BLOCK_N,  // one step of the block
        kStepTile = WARPS * BLOCK_N * KV_COLS,
    };
    const u16* k;
    const u16* v;
    const int* block_table;
    i64 bt_sb;
    int page_shift;
    i64 k_sb, k_sh, k_sn, v_sb, v_sh, v_sn;
    int b, hkv_head, s0, s1, kv_d, warp, lane;
    const u16* gK;
    const u16* gV;
    u16* ring;
    u16* ringK;
    u16* ringV;

    // Paged cache: k_sb / v_sb step pages, k_sn / v_sn keys within a page. Pages hold a power of
    // two >= 16 keys, so each 16-key group lies in one page; groups at or past s1 are zero-filled
    // without looking their page up. One warp copies the group of keys n .. n + 15.
    __device__ __forceinline__ void page_group(u16* dk, u16* dv, int n, bool do_k, bool do_v) const {
        const i64 page = n < s1 ? block_table[b * bt_sb + (n >> page_shift)] : 0;
        const int in_page = n & ((1 << page_shift) - 1);
        if (do_k)
            load_tile_rows<KV_COLS, 16, 32, VEC, 0>(
                dk, k + page * k_sb + hkv_head * k_sh + in_page * k_sn, k_sn, s1 - n, kv_d, lane);
        if (do_v)
            load_tile_rows<KV_COLS, 16, 32, VEC, 0>(
                dv, v + page * v_sb + hkv_head * v_sh + in_page * v_sn, v_sn, s1 - n, kv_d, lane);
    }

    // RING > 0 (the block ring: the block's threads copy each step's keys together, and warp w then
    // computes its share of them from shared memory): step t's K and / or V into slot `slot` (paged:
    // each warp its own groups).
    __device__ __forceinline__ void step(int t, int slot, bool do_k, bool do_v) const {
        const int n0 = s0 + t * kStepN;
        u16* dk = ringK + slot * kStepTile;
        u16* dv = ringV + slot * kStepTile;
        if (block_table == nullptr) {
            // (a step wholly inside the split's keys, rows of exactly HEAD_DIM: the predicate-free copy)
            if constexpr (VEC && tile_rows_full_fits<KV_COLS, kStepN, kThreads>()) {
                if (n0 + kStepN <= s1 && kv_d == KV_COLS) {
                    if (do_k)
                        load_tile_rows_full<KV_COLS, kStepN, kThreads, 0>(dk, gK + n0 * k_sn, k_sn, threadIdx.x);
                    if (do_v)
                        load_tile_rows_full<KV_COLS, kStepN, kThreads, 0>(dv, gV + n0 * v_sn, v_sn, threadIdx.x);
                    return;
                }
            }
            if (do_k)
                load_tile_rows<KV_COLS, kStepN, kThreads, VEC, 0>(dk, gK + n0 * k_sn, k_sn, s1 - n0, kv_d,
                                                                  threadIdx.x);
            if (do_v)
                load_tile_rows<KV_COLS, kStepN, kThreads, VEC, 0>(dv, gV + n0 * v_sn, v_sn, s1 - n0, kv_d,
                                                                  threadIdx.x);
        } else {
#pragma unroll
            for (int i = 0; i < BLOCK_N / 16; ++i) {
                const int row = warp * BLOCK_N + 16 * i;
                page_group(dk + row * KV_COLS, dv + row * KV_COLS, n0 + row, do_k, do_v);
            }
        }
    }

    // RING 0 (per-warp rings: each warp copies its own tiles, so the loop needs no block barrier):
    // this warp's tile t - keys s0 + (t WARPS + warp) BLOCK_N on - into its ring's slot `slot`.
    __device__ __forceinline__ void warp_tile(int t, int slot) const {
        const int n0 = s0 + (t * WARPS + warp) * BLOCK_N;
        u16* dk = ring + slot * kTileKV;
        u16* dv = ring + (STAGES + slot) * kTileKV;
        if (block_table == nullptr) {
            load_tile_rows<KV_COLS, BLOCK_N, 32, VEC, 0>(dk, gK + n0 * k_sn, k_sn, s1 - n0, kv_d, lane);
            load_tile_rows<KV_COLS, BLOCK_N, 32, VEC, 0>(dv, gV + n0 * v_sn, v_sn, s1 - n0, kv_d, lane);
        } else {
#pragma unroll
            for (int g = 0; g < BLOCK_N / 16; ++g)
                page_group(dk + 16 * g * KV_COLS, dv + 16 * g * KV_COLS, n0 + 16 * g, true, true);
        }
    }
};
