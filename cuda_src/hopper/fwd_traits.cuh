// The Hopper forward's compile-time shape (HopperFwdTraits) and its run-time extras: the TMA
// kernels' tensor maps (FwdMaps) and the key split's workspace (FwdSplit).
#pragma once
#include "common.cuh"
#include "wgmma.cuh"
#include "tma.cuh"

// The tensor maps of attn_fwd_wgmma_tma (parameter space), null for the cp.async kernels.
struct FwdMaps {
    const TmaDesc* q;
    const TmaDesc* k;
    const TmaDesc* v;
};

// The key split of attn_fwd_wgmma_tma_split (full attention on a grid of fewer query tiles than
// SMs, which a block per tile would leave mostly idle): every query tile runs as `splits` key
// ranges (pieces). Pieces 0 .. splits-2 of tile t write their normalized O (float32, in
// accumulator order) and log-sum-exp to partial slot t * (splits - 1) + piece and count
// themselves in flags[t]; the last piece, launched after them, waits for that count, merges the
// partials by the log-sum-exp rule in piece order and stores O and the LSE, then zeroes flags[t]
// for the next launch on the stream.
struct FwdSplit {
    int splits;
    float* part_o;
    float* part_lse;
    unsigned* flags;
};

template <int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PRODUCER, bool TMA = false>
struct HopperFwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;     // padded head dim on chip (64 .. 256)
    static constexpr int kBlockN = BLOCK_N;       // keys per K/V tile
    static constexpr int kWarpgroups = WARPGROUPS;  // math warpgroups
    static constexpr int kMathThreads = 128 * WARPGROUPS;
    static constexpr int kThreads = kMathThreads + (PRODUCER ? 128 : 0);
    static constexpr int kLoadThreads = PRODUCER ? 128 : kThreads;
    // Registers after setmaxnreg: the producer keeps 40 (24 when one thread only issues TMA
    // copies), the math warpgroups share the rest.
    static constexpr int kProducerRegs = TMA ? 24 : 40;
    static constexpr int kMathRegs = ((65536 / 128 - kProducerRegs) / WARPGROUPS) / 8 * 8 > 240
                                         ? 240 : ((65536 / 128 - kProducerRegs) / WARPGROUPS) / 8 * 8;
    static constexpr int kBlockM = 64 * WARPGROUPS;  // wgmma's M is 64 rows per warpgroup
    static constexpr int kStages = STAGES;
    // (causal, one tile per block) launch order: longest first within groups of this many (head,
    // batch) pairs (lpt_head_groups), as the backward's HopperBwdTraits::kLptHeads.
    static constexpr int kLptHeads = 4;
    using TileQ = Sw128Tile<HEAD_DIM, kBlockM>;
    using TileKV = Sw128Tile<HEAD_DIM, BLOCK_N>;
    // mbarriers (PRODUCER): Q full, then K full, V full, K empty, V empty per stage.
    static constexpr int kBarriers = PRODUCER ? 1 + 4 * STAGES : 0;
    // + 1024: the dynamic shared-memory base is rounded up to the swizzle pattern's period.
    static constexpr int kSmemBytes = TileQ::kBytes + 2 * STAGES * TileKV::kBytes + 8 * kBarriers + 1024;
    static_assert(STAGES >= 2, "a K (and a V) tile in use while the next one loads");
    static_assert(!TMA || PRODUCER, "TMA copies are issued by a producer warpgroup");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 64 == 0, "whole wgmma k-steps and swizzle atoms");
};
