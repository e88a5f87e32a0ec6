// The Hopper backward's loads. Warp-specialized (WS): the producer warpgroup's warp 0 fills the
// two-stage Q/dO ring by TMA on full/empty mbarriers (kProducerStats: with each step's lse and D),
// and its warp 1 adds the math warpgroups' staged dQ tiles to global memory (bulk reduce-add).
#pragma once
#include "hopper/bwd_smem.cuh"
#include "hopper/bwd_scheduler.cuh"

// (WS producer, warp 0) lane 0: the Q/dO boxes of every step; (kProducerStats) every lane: the
// step's lse (in its stored form, log2 units, +inf for rows past nq) and D.
template <typename Tr, bool kProducerStats, typename Sched>
__device__ __forceinline__ void bwd_produce_qdo(const BwdSmem<Tr>& sm, const Sched& sched, const BwdMaps& maps,
                                                const float* lse, const float* dsum, int hq, int nq, int lane) {
    using TileQ = typename Tr::TileQ;
    constexpr int HEAD_DIM = Tr::kHeadDim, BLOCK_M = Tr::kBlockM;
    constexpr float kLog2e = 1.4426950408889634f;
    BWD_FOR_EACH_STEP(sched, {
        const int buf = g & 1;
        const u32 bar = sm.sBar + 8 * buf;
        mbar_wait(sm.sEmpty + 8 * buf, ((g >> 1) & 1) ^ 1);
        if (lane == 0) {  // the boxes first (their bytes expected), so the loads below overlap them
            if constexpr (kProducerStats) mbar_expect_tx(bar, 2 * TileQ::kBytes);
            else mbar_arrive_expect_tx(bar, 2 * TileQ::kBytes);
            _Pragma("unroll") for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
                tma_load_4d(sm.sQ + buf * TileQ::kBytes + cb * TileQ::kBlockBytes, maps.q, 64 * cb, m0, h, t.b, bar);
                tma_load_4d(sm.sdO + buf * TileQ::kBytes + cb * TileQ::kBlockBytes, maps.dout, 64 * cb, m0, h, t.b, bar);
            }
        }
        if constexpr (kProducerStats) {
            const int rows = min(BLOCK_M, nq - m0);
            const i64 stat = ((i64)t.b * hq + h) * nq + m0;
            for (int i = lane; i < BLOCK_M; i += 32) {
                const float l = i < rows ? lse[stat + i] : -INFINITY;
                sm.sL[buf * BLOCK_M + i] = l == -INFINITY ? INFINITY : l * kLog2e;
                sm.sD[buf * BLOCK_M + i] = i < rows ? dsum[stat + i] : 0.f;
            }
            mbar_arrive(bar);  // each lane after its own stores (32 arrivals)
        }
    })
}

// (WS producer, warp 1) dQ: each step, math warpgroup w's staged 64 x 64 float32 tile (named
// barrier 6 + w) added by one bulk reduce-add into the fragment-order accumulator, the tile freed
// again (barrier 8 + w) once the copy engine has read it.
template <typename Tr, int WARPGROUPS, typename Sched>
__device__ __forceinline__ void bwd_reduce_dq(const BwdSmem<Tr>& sm, const Sched& sched, float* dq_acc, int hq,
                                              int row_tiles, int lane) {
    constexpr int kDqN = Tr::kDqCols, HEAD_DIM = Tr::kHeadDim;
    constexpr int kDqBarThreads = 128 + 32;
    // The tiles start free; then each step frees them again: 1 + steps arrivals, one
    // per math-side wait (one per step, and one at the end).
    for (int w = 0; w < WARPGROUPS; ++w) named_barrier_arrive(8 + w, kDqBarThreads);
    BWD_FOR_EACH_STEP(sched, {
        // Both warpgroups' reduce-adds in flight together; tile w is free again once
        // its group has been read (wait_group.read 1 - w: the newer one may still run).
        _Pragma("unroll") for (int w = 0; w < 2; ++w) {
            named_barrier(6 + w, kDqBarThreads);  // math warpgroup w staged its tile
            const int rt = (m0 + (Tr::kDqByRows ? 64 * w : 0)) / 64;
            const int cb = Tr::kDqByColumns ? w * kDqN / 64 : 0;
            float* chunk = dq_acc + ((((i64)t.b * hq + h) * row_tiles + rt) * (HEAD_DIM / 64) + cb) * 4096;
            // (a 128-query step's second half can lie wholly past nq: no chunk there)
            if (lane == 0) {
                if (rt < row_tiles) bulk_reduce_add_f32(chunk, sm.sDq + w * Tr::kDqTileBytes, Tr::kDqTileBytes);
                bulk_commit();  // (an empty group when skipped, so the counts below hold)
            }
        }
        if (lane == 0) bulk_wait_read<1>();
        __syncwarp();
        named_barrier_arrive(8, kDqBarThreads);
        if (lane == 0) bulk_wait_read<0>();
        __syncwarp();
        named_barrier_arrive(9, kDqBarThreads);
    })
    if (lane == 0) bulk_wait<0>();
}

// A 16-bit tensor in global memory: its base and (batch, head, row) strides in elements.
struct BwdTensor {
    const u16* p;
    i64 sb, sh, sn;
    __device__ __forceinline__ const u16* at(int b, int h, int row) const { return p + b * sb + h * sh + row * sn; }
};

// The unit's K and V tiles (keys past nk zero-filled). PERSISTENT: by TMA, once the previous
// unit's dK/dV, staged in their tiles through the generic proxy, have been stored (cp.async here
// would keep each thread's 16 chunk addresses live through the whole unit: 240 registers do not
// hold them); else by cp.async from the kLoaders math threads.
template <typename Tr, bool PERSISTENT, int kLoaders>
__device__ __forceinline__ void bwd_load_kv(const BwdSmem<Tr>& sm, const BwdMaps& maps, const BwdTensor& k, const BwdTensor& v,
                                            int n0, int hk, int b, int keys_valid, int d,
                                            int units_done, int tid) {
    using TileKV = typename Tr::TileKV;
    constexpr int HEAD_DIM = Tr::kHeadDim, kBN = Tr::kBlockN;
    if constexpr (PERSISTENT) {
        fence_proxy_async();
        named_barrier(1, Tr::kThreads);
        if (tid == 0) {
            mbar_arrive_expect_tx(sm.sKvFull, 2 * TileKV::kBytes);
#pragma unroll
            for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
                tma_load_4d(sm.sK + cb * TileKV::kBlockBytes, maps.k, 64 * cb, n0, hk, b, sm.sKvFull);
                tma_load_4d(sm.sV + cb * TileKV::kBlockBytes, maps.v, 64 * cb, n0, hk, b, sm.sKvFull);
            }
        }
        mbar_wait(sm.sKvFull, units_done & 1);
    } else {
        load_sw128<HEAD_DIM, kBN, kLoaders>(sm.sK, k.at(b, hk, n0), k.sn, keys_valid, d, tid);
        load_sw128<HEAD_DIM, kBN, kLoaders>(sm.sV, v.at(b, hk, n0), v.sn, keys_valid, d, tid);
    }
}

// (not WS) one step's Q and dO tiles into buffer buf, by TMA (thread 0; rows past nq and columns
// past d zero-filled by the copy engine) or by cp.async from every thread, and its lse and D
// (cp.async; fix_row_stats turns them into their stored form once landed).
template <typename Tr, bool TMA>
__device__ __forceinline__ void bwd_load_step(const BwdSmem<Tr>& sm, const BwdMaps& maps, const BwdTensor& q,
                                              const BwdTensor& dout, const float* lse, const float* dsum, int b, int h,
                                              int m0, int hq, int nq, int d, int buf, int tid) {
    using TileQ = typename Tr::TileQ;
    constexpr int HEAD_DIM = Tr::kHeadDim, BLOCK_M = Tr::kBlockM, kThreads = Tr::kThreads;
    const int rows = min(BLOCK_M, nq - m0);
    if constexpr (TMA) {
        if (tid == 0) {
            const u32 bar = sm.sBar + 8 * buf;
            mbar_arrive_expect_tx(bar, 2 * TileQ::kBytes);
#pragma unroll
            for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
                tma_load_4d(sm.sQ + buf * TileQ::kBytes + cb * TileQ::kBlockBytes, maps.q, 64 * cb, m0, h, b, bar);
                tma_load_4d(sm.sdO + buf * TileQ::kBytes + cb * TileQ::kBlockBytes, maps.dout, 64 * cb, m0, h, b, bar);
            }
        }
    } else {
        load_sw128<HEAD_DIM, BLOCK_M, kThreads>(sm.sQ + buf * TileQ::kBytes, q.at(b, h, m0), q.sn, rows, d, tid);
        load_sw128<HEAD_DIM, BLOCK_M, kThreads>(sm.sdO + buf * TileQ::kBytes, dout.at(b, h, m0), dout.sn, rows, d, tid);
    }
    load_row_stats_async<BLOCK_M, kThreads>(sm.sL, sm.sD, buf, lse, dsum, ((i64)b * hq + h) * nq + m0, rows, tid);
}

// (WS) The producer warpgroup, at 24 registers: warp 0 fills the Q/dO ring (lane 0 the boxes; with
// kProducerStats every lane copies lse and D), warp 1 adds the math warpgroups' dQ tiles.
// tid: the block's thread index (the producer's threads follow the math warpgroups' Tr::kThreads).
template <typename Tr, int WARPGROUPS, bool kProducerStats, typename Sched>
__device__ __forceinline__ void bwd_producer_warpgroup(const BwdSmem<Tr>& sm, const Sched& sched, const BwdMaps& maps,
                                                       const float* lse, const float* dsum, float* dq_acc, int hq, int nq,
                                                       int tid, int lane) {
    setmaxnreg_dec<24>();
    const int pwarp = (tid - Tr::kThreads) >> 5;
    const int row_tiles = (nq + 63) / 64;
    if (pwarp == 0) {
        if (kProducerStats || lane == 0) bwd_produce_qdo<Tr, kProducerStats>(sm, sched, maps, lse, dsum, hq, nq, lane);
    } else if (pwarp == 1) {
        bwd_reduce_dq<Tr, WARPGROUPS>(sm, sched, dq_acc, hq, row_tiles, lane);
    }
}
