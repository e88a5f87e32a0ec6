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

// e4m3 inputs with an OUT (Fp16 / Bf16) output: the element type of attn_fwd_wgmma_tma_fp8. Its
// is_bf16 is the output's, for the epilogue's pack2.
template <typename OUT>
struct E4m3 {
    static constexpr bool is_bf16 = OUT::is_bf16;
};

// The element policy of the Hopper forward. 16-bit inputs (Fp16, Bf16): wgmma m64nNk16, V read
// N-major from its (keys, d) tile. e4m3 inputs (E4m3<OUT>): m64nNk32, whose 8-bit operands must
// both be K-major, so V arrives as vt, its transpose (d, keys) built by the launcher
// (hopper/fwd_fp8.cuh); the scores' scale carries q's and k's descales, the output v's.
template <typename T>
struct FwdElem {
    static constexpr bool kFp8 = false;
    static constexpr int kBytes = 2;  // bytes per input element
    static constexpr int kK = 16;     // wgmma's K: elements per instruction (32 bytes)
};
template <typename OUT>
struct FwdElem<E4m3<OUT>> {
    static constexpr bool kFp8 = true;
    static constexpr int kBytes = 1;
    static constexpr int kK = 32;
};

// A if C else B (no <type_traits>: the sources compile without include paths).
template <bool C, typename A, typename B>
struct FwdPick {
    using type = A;
};
template <typename A, typename B>
struct FwdPick<false, A, B> {
    using type = B;
};

// HEAD_DIM_V: V's and O's head dim where it differs from Q's and K's (DeepSeek MLA's prefill,
// d = 192 / dv = 128): V's ring slots, O's accumulators and P V's wgmma are HEAD_DIM_V wide, so
// nothing is padded to the wider one (16-bit inputs, the per-tile TMA kernel attn_fwd_wgmma_tma_dv).
template <int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PRODUCER, bool TMA = false,
          typename ELEM = FwdElem<Bf16>, int HEAD_DIM_V = HEAD_DIM>
struct HopperFwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;     // Q's and K's padded head dim on chip (64 .. 256)
    static constexpr int kHeadDimV = HEAD_DIM_V;  // V's and O's
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
    static constexpr bool kFp8 = ELEM::kFp8;
    static constexpr int kElemBytes = ELEM::kBytes;
    // Sw128Tile counts 16-bit columns: an e4m3 row of HEAD_DIM bytes is HEAD_DIM / 2 of them.
    using TileQ = Sw128Tile<HEAD_DIM * ELEM::kBytes / 2, kBlockM>;
    using TileK = Sw128Tile<HEAD_DIM * ELEM::kBytes / 2, BLOCK_N>;  // K's ring slots
    // (e4m3) Keys of vt's ring slot: whole 128-key TMA boxes (a 128-byte swizzled row is one box's
    // width), so a 160-224-key tile reads up to 96 keys past its own, which P V does not use.
    static constexpr int kVtKeys = (BLOCK_N + 127) / 128 * 128;
    // V's ring slots: V's own (keys, HEAD_DIM_V) tile, or (e4m3) vt's (d, kVtKeys) tile.
    using TileV = typename FwdPick<kFp8, Sw128Tile<kVtKeys / 2, HEAD_DIM>, Sw128Tile<HEAD_DIM_V, BLOCK_N>>::type;
    // O (16-bit) staged for the store: in Q's rows, which a wider O (e4m3 inputs, or HEAD_DIM_V >
    // HEAD_DIM) outgrows into the K ring.
    using TileO = Sw128Tile<HEAD_DIM_V, kBlockM>;
    static constexpr int kQkSteps = HEAD_DIM / ELEM::kK;  // wgmma k-steps of Q K^T
    static constexpr int kPvSteps = BLOCK_N / ELEM::kK;   // of P V: P's A fragments
    // mbarriers (PRODUCER): Q full, then K full, V full, K empty, V empty per stage.
    static constexpr int kBarriers = PRODUCER ? 1 + 4 * STAGES : 0;
    // + 1024: the dynamic shared-memory base is rounded up to the swizzle pattern's period.
    static constexpr int kSmemBytes = TileQ::kBytes + STAGES * (TileK::kBytes + TileV::kBytes) + 8 * kBarriers + 1024;
    static_assert(STAGES >= 2, "a K (and a V) tile in use while the next one loads");
    static_assert(!TMA || PRODUCER, "TMA copies are issued by a producer warpgroup");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0,
                  "whole wgmma k-steps and swizzle atoms");
    static_assert(!kFp8 || (TMA && HEAD_DIM % 128 == 0 && BLOCK_N % 32 == 0),
                  "e4m3: TMA-fed, whole 128-byte swizzle rows of Q and K, whole k32 steps (vt's 32-key groups)");
    // (the cp.async loaders fill both rings with K's tile; e4m3's vt is built at one head dim)
    static_assert(HEAD_DIM_V == HEAD_DIM || (TMA && !kFp8), "a V head dim of its own: 16-bit inputs, TMA-fed");
    static_assert(TileO::kBytes <= TileQ::kBytes + STAGES * TileK::kBytes, "O staged over Q and the K ring");
};
