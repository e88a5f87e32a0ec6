// The Hopper backward's shared memory: the block's K and V tiles, two buffers each of Q and dO,
// dS^T (one or two buffers), (split S) P^T, two buffers of the step's row statistics (lse, D), the mbarriers of
// the TMA kernels and (WS) each math warpgroup's dQ staging tile.
#pragma once
#include "hopper/bwd_traits.cuh"

template <typename Tr>
struct BwdSmem {
    using TileQ = typename Tr::TileQ;
    using TileKV = typename Tr::TileKV;
    using TileS = typename Tr::TileS;
    static constexpr int kDsBytes = Tr::kDsBuffers * TileS::kBytes;
    static constexpr int kPtBytes = Tr::kSplitS ? TileS::kBytes : 0;
    u32 sK, sV, sQ, sdO, sdS, sPt;
    float *sL, *sD;
    u32 sBar, sEmpty, sKvFull, sDq;
    __device__ __forceinline__ explicit BwdSmem(unsigned char* smem_raw) {
        sK = (smem_addr(smem_raw) + 1023u) & ~1023u;
        sV = sK + TileKV::kBytes;
        sQ = sV + TileKV::kBytes;       // 2 buffers
        sdO = sQ + 2 * TileQ::kBytes;   // 2 buffers
        sdS = sdO + 2 * TileQ::kBytes;  // Tr::kDsBuffers buffers
        sPt = sdS + kDsBytes;           // (split S) P^T
        sL = reinterpret_cast<float*>(smem_raw + (sPt + kPtBytes - smem_addr(smem_raw)));  // 2 x BLOCK_M
        sD = sL + 2 * Tr::kBlockM;                                                        // 2 x BLOCK_M
        sBar = sPt + kPtBytes + 4 * Tr::kBlockM * 4;  // (TMA) buffer b's tiles landed: sBar + 8 b
        sEmpty = sBar + 16;                           // (WS) buffer b free again: sEmpty + 8 b
        sKvFull = sBar + 32;                          // (PERSISTENT) the unit's K and V landed
        sDq = (sBar + 40 + 127u) & ~127u;             // (WS) warpgroup w's dQ tile: + w kDqTileBytes
    }

    // (TMA, one thread) "full": the thread issuing the copies (with their bytes) and, with the
    // producer's row statistics, the other lanes of its warp after their lse/D stores (full_count);
    // (WS) "empty": every math thread; (PERSISTENT) the unit's K and V.
    template <bool WS, bool PERSISTENT>
    __device__ __forceinline__ void init_barriers(int full_count, int math_threads) const {
        mbar_init(sBar, full_count);
        mbar_init(sBar + 8, full_count);
        if constexpr (WS) {
            mbar_init(sEmpty, math_threads);
            mbar_init(sEmpty + 8, math_threads);
        }
        if constexpr (PERSISTENT) mbar_init(sKvFull, 1);
        fence_mbar_init();
    }
};
