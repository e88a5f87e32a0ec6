// The persistent forward's static tile schedule (attn_fwd_wgmma_tma_persistent).
//
// gridDim.x blocks (one per SM) walk a list of work units; block c takes units c, c + G, c + 2G,
// ... A unit is one query tile, or under a causal mask the pair (m, M-1-m), heavy one first, so
// that every unit has about the same number of key tiles (a static schedule over unequal tiles
// leaves blocks idle: 0.7x of the per-tile kernel at N = 16k causal before pairing). A head's
// units are consecutive, so tiles in flight together share K and V in L2.
#pragma once
#include "common.cuh"

template <bool CAUSAL, bool PERSISTENT>
struct FwdTileScheduler {
    static constexpr int kUnitTiles = CAUSAL ? 2 : 1;
    int m_blocks, units_per_head, n_units;
    __device__ __forceinline__ FwdTileScheduler(int nq, int block_m, int n_heads, int n_batch) {
        m_blocks = (nq + block_m - 1) / block_m;
        units_per_head = (m_blocks + kUnitTiles - 1) / kUnitTiles;
        n_units = PERSISTENT ? units_per_head * n_heads * n_batch : 1;
    }
    // Query tile k (0, 1) of unit u, -1 for none.
    __device__ __forceinline__ int unit_tile(int u, int k) const {
        const int pair = u % units_per_head;
        if (k == 0) return m_blocks - 1 - pair;
        return CAUSAL && pair != m_blocks - 1 - pair ? pair : -1;
    }
    // tile(bh, m_block) for each of this block's query tiles in order, bh = batch * heads + head.
    // Every role (the producer's loads, the math) walks the same tiles.
    template <typename F>
    __device__ __forceinline__ void for_each_tile(F&& tile) const {
        for (int u = blockIdx.x; u < n_units; u += gridDim.x)
            for (int kt = 0; kt < kUnitTiles; ++kt) {
                const int mb = unit_tile(u, kt);
                if (mb < 0) continue;
                tile(u / units_per_head, mb);
            }
    }
};
