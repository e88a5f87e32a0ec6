// The Hopper backward's dQ (atomic mode): dQ += dS K once per step from dS^T in shared memory,
// split over the warpgroups by query rows, by head-dim columns, or (otherwise) by keys, then added
// to the float32 accumulator: one red.global.add.v2 per element pair, or (WS) staged in the
// warpgroup's shared-memory tile for the producer's dQ warp to add with one bulk reduce-add, or
// (kDqStagedInQdO) staged in the step's own Q/dO tiles and added by the warpgroup's first thread.
#pragma once
#include "hopper/bwd_smem.cuh"

// This warpgroup's share of dQ: its first query row and column within the step, and its first key.
template <typename Tr>
struct BwdDqSplit {
    static constexpr int kCols = Tr::kDqCols;
    int q0, col0, key0;
    __device__ __forceinline__ explicit BwdDqSplit(int wg) {
        q0 = Tr::kDqByRows ? 64 * wg : 0;  // first query of this warpgroup's dQ rows
        col0 = Tr::kDqByColumns ? wg * kCols : 0;
        key0 = Tr::kDqBlockSync ? 0 : 64 * wg;
    }
};

// dS^T stored (generic proxy) and visible to every warpgroup whose dQ reads it: the math warpgroups
// meet (dQ by rows or columns), or each warpgroup alone (by keys: only its own rows are read).
template <typename Tr, bool WS>
__device__ __forceinline__ void bwd_dq_sync(int wg) {
    fence_proxy_async();
    if constexpr (Tr::kDqBlockSync) {
        if constexpr (WS) named_barrier(1, Tr::kThreads);
        else __syncthreads();  // every warpgroup's dS^T rows are in place
    } else {
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg));  // only this warpgroup's rows are read
    }
}

// dQ(rows)[:, cols] = dS K, one commit group: M = queries (dS^T read M-major), K = keys, N = cols of K.
template <typename T, typename Tr, int kNQ>
__device__ __forceinline__ void bwd_issue_dq(float (&acc_q)[kNQ][4], const BwdDqSplit<Tr>& dq, u32 tds, u32 sK) {
    using TileS = typename Tr::TileS;
    using TileKV = typename Tr::TileKV;
#pragma unroll
    for (int kk = 0; kk < Tr::kDqKeys / 16; ++kk) {
        const u32 rows = (dq.key0 + kk * 16) * 128;
        Wgmma<T, Tr::kDqCols>::template ss<1, 1>(
            acc_q, sw128_desc(tds + (dq.q0 / 64) * TileS::kBlockBytes + rows, TileS::kBlockBytes, 1024),
            sw128_desc(sK + (dq.col0 / 64) * TileKV::kBlockBytes + rows, TileKV::kBlockBytes, 1024), kk > 0);
    }
    wgmma_commit();
}

// The step's dQ fragment added into the accumulator (rows past nq dropped), or (WS) staged for the dQ warp.
template <typename Tr, bool WS, int kNQ>
__device__ __forceinline__ void bwd_store_dq(const float (&acc_q)[kNQ][4], const BwdDqSplit<Tr>& dq, const BwdSmem<Tr>& sm,
                                             float* dq_acc, int b, int h, int hq, int nq, int m0, int wg, int tid,
                                             int warp, int lane) {
    constexpr int kDqN = Tr::kDqCols, HEAD_DIM = Tr::kHeadDim;
    constexpr int kDqBarThreads = 128 + 32;
    if constexpr (WS) {
        // Fragment order, float4 k of thread t at (k * 128 + t) * 16 bytes (conflict-free):
        // what attn_bwd_dq_convert<..., true> undoes. Wait for the dQ warp to free the tile.
        named_barrier(8 + wg, kDqBarThreads);
        const u32 tile = sm.sDq + wg * Tr::kDqTileBytes + (tid & 127) * 16;
#pragma unroll
        for (int ni = 0; ni < kDqN / 8; ++ni)
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + ni * 128 * 16), "f"(acc_q[ni][0]),
                         "f"(acc_q[ni][1]), "f"(acc_q[ni][2]), "f"(acc_q[ni][3]));
        fence_proxy_async();  // the bulk reduce reads it through the async proxy
        named_barrier_arrive(6 + wg, kDqBarThreads);
    } else {
        float* gq = dq_acc + (((i64)b * hq + h) * nq + m0 + dq.q0) * HEAD_DIM + dq.col0;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = 16 * warp + (lane >> 2) + 8 * hf;
            if (m0 + dq.q0 + row < nq) {
#pragma unroll
                for (int ni = 0; ni < kDqN / 8; ++ni)
                    red_add_v2(gq + (i64)row * HEAD_DIM + ni * 8 + 2 * (lane & 3), acc_q[ni][2 * hf], acc_q[ni][2 * hf + 1]);
            }
        }
    }
}

// (kDqStagedInQdO) this warpgroup's 64 x 128 dQ, once its own products are done (the other
// warpgroup's may still read their columns), into its columns of the step's Q tile (chunk 0) and
// dO tile (chunk 1), fragment order as the WS tile's; then its first thread adds both chunks into
// the fragment-order accumulator by bulk reduce-adds. That thread waits for their reads before
// the buffer is refilled (bwd_dq_staged_read) and for their completion at the end.
template <typename Tr, int kNQ>
__device__ __forceinline__ void bwd_add_dq_staged(const float (&acc_q)[kNQ][4], u32 tq, u32 tdo, float* dq_acc, int b,
                                                  int h, int hq, int nq, int m0, int wg, int tid) {
    using TileQ = typename Tr::TileQ;
    constexpr int kChunkNi = 8;  // 8-column blocks per 64 x 64 chunk
    static_assert(kNQ == 2 * kChunkNi && Tr::kBlockM == 64, "two 64 x 64 chunks per warpgroup, 64-query steps");
    const u32 region = wg * (Tr::kDkvCols / 64) * TileQ::kBlockBytes;  // its 16 KiB of each tile
    const int t = tid & 127;
#pragma unroll
    for (int ni = 0; ni < kNQ; ++ni) {
        const u32 tile = (ni < kChunkNi ? tq : tdo) + region + ((ni % kChunkNi) * 128 + t) * 16;
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile), "f"(acc_q[ni][0]), "f"(acc_q[ni][1]),
                     "f"(acc_q[ni][2]), "f"(acc_q[ni][3]));
    }
    fence_proxy_async();  // the bulk reduce reads it through the async proxy
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg));
    if (t == 0) {
        const int row_tiles = (nq + 63) / 64;
        float* chunk = dq_acc + ((((i64)b * hq + h) * row_tiles + m0 / 64) * (Tr::kHeadDim / 64) + 2 * wg) * 4096;
        bulk_reduce_add_f32(chunk, tq + region, 64 * 64 * 4);
        bulk_reduce_add_f32(chunk + 4096, tdo + region, 64 * 64 * 4);
        bulk_commit();
    }
}

// (kDqStagedInQdO) the staging thread of each warpgroup: its reduce-adds have read the tiles, so
// they may be refilled or reused.
template <typename Tr>
__device__ __forceinline__ void bwd_dq_staged_read(int tid) {
    if constexpr (Tr::kDqStagedInQdO) {
        if ((tid & 127) == 0) bulk_wait_read<0>();
    }
}
