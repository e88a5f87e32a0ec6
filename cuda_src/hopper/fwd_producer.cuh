// The Hopper forward's loads: K/V tiles by cp.async (every thread, or the producer warpgroup), and
// the TMA producer's bulk tensor copies, issued by one thread in the order the math warpgroups
// consume them (Q and K_0, then K_{j+1} before V_j).
#pragma once
#include "hopper/fwd_smem.cuh"
#include "hopper/fwd_fp8.cuh"

// Key tile j of K or V into its ring slot by cp.async (one head dim: K's and V's slots are alike);
// ltid: this thread's index among the loading threads (all of them, or the producer's, whose
// loops stay rolled to fit its registers).
template <typename Tr, bool PRODUCER>
__device__ __forceinline__ void fwd_load_kv(u32 ring, const u16* g, i64 sn, int nk_b, int d, int j, int ltid) {
    const int n0 = j * Tr::kBlockN;
    load_sw128<Tr::kHeadDim, Tr::kBlockN, Tr::kLoadThreads, !PRODUCER>(ring + (j % Tr::kStages) * Tr::TileK::kBytes,
                                                                       g + n0 * sn, sn, nk_b - n0, d, ltid);
}

// The cp.async producer warpgroup: fill slot j % STAGES once the math warpgroups released its
// previous tile (the n-th refill waits for phase n-1 of "empty"; a fresh barrier passes parity 1).
template <typename Tr, typename Smem>
__device__ __forceinline__ void fwd_cp_async_producer(const Smem& sm, const u16* gQ, const u16* gK, const u16* gV,
                                                      i64 q_sn, i64 k_sn, i64 v_sn, int rows_valid, int nk_b, int d,
                                                      int n_tiles, int ltid) {
    load_sw128<Tr::kHeadDim, Tr::kBlockM, Tr::kLoadThreads, false>(sm.sQ, gQ, q_sn, rows_valid, d, ltid);
    cp_async_mbar_arrive(sm.full_q());
    for (int j = 0; j < n_tiles; ++j) {
        const int s = j % Tr::kStages;
        const u32 parity = ((j / Tr::kStages) & 1) ^ 1;
        mbar_wait(sm.empty_k(s), parity);
        fwd_load_kv<Tr, true>(sm.sK, gK, k_sn, nk_b, d, j, ltid);
        cp_async_mbar_arrive(sm.full_k(s));
        mbar_wait(sm.empty_v(s), parity);
        fwd_load_kv<Tr, true>(sm.sV, gV, v_sn, nk_b, d, j, ltid);
        cp_async_mbar_arrive(sm.full_v(s));
    }
    cp_async_wait<0>();
}

// One box copy of `rows` rows: a box per 128-byte column block (64 16-bit or 128 e4m3 columns),
// completing on `bar`.
template <int HEAD_DIM, int ELEM_BYTES = 2>
__device__ __forceinline__ void fwd_tma_issue(u32 dst, const TmaDesc* map, int rows, int row0, int head, int b, u32 bar) {
    constexpr int kBlocks = HEAD_DIM * ELEM_BYTES / 128, kCols = 128 / ELEM_BYTES;
    mbar_arrive_expect_tx(bar, kBlocks * rows * 128);
#pragma unroll
    for (int cb = 0; cb < kBlocks; ++cb) tma_load_4d(dst + cb * rows * 128, map, kCols * cb, row0, head, b, bar);
}

// The TMA producer's copies for one query tile: Q, then K_0, K_{j+1} before V_j (e4m3: vt's tile
// j; V's columns are its own head dim's, Tr::kHeadDimV). m0: the tile's first row, k0: its first
// key tile's first key (a key split's piece, a band's first visible tile; packed sequences: both
// counted in the packed rows); kv0: the ring's count before this tile, q_phase: the tile's parity
// (persistent).
template <typename Tr, bool PERSISTENT, typename Smem>
__device__ __forceinline__ void fwd_tma_tile_loads(const Smem& sm, const FwdMaps& maps, int m0, int h, int hk, int b,
                                                   int n_tiles, int kv0, u32 q_phase, int k0) {
    constexpr int kStages = Tr::kStages, kBN = Tr::kBlockN;
    auto issue_k = [&](int j) {
        const int g = kv0 + j, s = g % kStages;
        mbar_wait(sm.empty_k(s), ((g / kStages) & 1) ^ 1);
        fwd_tma_issue<Tr::kHeadDim, Tr::kElemBytes>(sm.k_slot(s), maps.k, kBN, k0 + j * kBN, hk, b, sm.full_k(s));
    };
    if constexpr (PERSISTENT) {
        // K_0 needs only its ring slot; Q waits until the previous tile's last Q K^T retired.
        if (n_tiles > 0) issue_k(0);
        mbar_wait(sm.empty_q(), q_phase ^ 1);
        fwd_tma_issue<Tr::kHeadDim, Tr::kElemBytes>(sm.sQ, maps.q, Tr::kBlockM, m0, h, b, sm.full_q());
    } else {
        fwd_tma_issue<Tr::kHeadDim, Tr::kElemBytes>(sm.sQ, maps.q, Tr::kBlockM, m0, h, b, sm.full_q());
        if (n_tiles > 0) issue_k(0);
    }
    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) issue_k(j + 1);
        const int g = kv0 + j, s = g % kStages;
        mbar_wait(sm.empty_v(s), ((g / kStages) & 1) ^ 1);
        if constexpr (Tr::kFp8) fwd_tma_issue_vt<Tr>(sm.v_slot(s), maps.v, k0 + j * kBN, hk, b, sm.full_v(s));
        else fwd_tma_issue<Tr::kHeadDimV>(sm.v_slot(s), maps.v, kBN, k0 + j * kBN, hk, b, sm.full_v(s));
    }
}

// (warp-specialized, thread 0) The mbarriers. "full": every loading thread's cp.async arrival,
// or the one TMA thread's expect_tx; "empty": every math thread's release.
template <typename Tr, bool TMA, bool PERSISTENT, typename Smem>
__device__ __forceinline__ void fwd_init_barriers(const Smem& sm) {
    constexpr int kFull = TMA ? 1 : Tr::kLoadThreads;
    mbar_init(sm.full_q(), kFull);
    for (int s = 0; s < Tr::kStages; ++s) {
        mbar_init(sm.full_k(s), kFull);
        mbar_init(sm.full_v(s), kFull);
        mbar_init(sm.empty_k(s), Tr::kMathThreads);
        mbar_init(sm.empty_v(s), Tr::kMathThreads);
    }
    if constexpr (PERSISTENT) mbar_init(sm.empty_q(), Tr::kMathThreads);
    if constexpr (TMA) fence_mbar_init();
}

// (cp.async without a producer: every thread loads) Q and the first key tiles. Commit group g
// holds K tile g and V tile g-1 (group 0 also Q): the loop's iteration j needs K_{j+1} and V_j,
// i.e. group j+1, and issues group j+STAGES.
template <typename Tr, typename Smem>
__device__ __forceinline__ void fwd_cp_async_prologue(const Smem& sm, const u16* gQ, const u16* gK, const u16* gV,
                                                      i64 q_sn, i64 k_sn, i64 v_sn, int rows_valid, int nk_b, int d,
                                                      int n_tiles, int tid) {
    load_sw128<Tr::kHeadDim, Tr::kBlockM, Tr::kThreads>(sm.sQ, gQ, q_sn, rows_valid, d, tid);
#pragma unroll
    for (int g = 0; g < Tr::kStages; ++g) {
        if (g < n_tiles) fwd_load_kv<Tr, false>(sm.sK, gK, k_sn, nk_b, d, g, tid);
        if (g >= 1 && g - 1 < n_tiles) fwd_load_kv<Tr, false>(sm.sV, gV, v_sn, nk_b, d, g - 1, tid);
        cp_async_commit();
    }
}
