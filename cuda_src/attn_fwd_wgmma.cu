// Tiled forward attention for Hopper (sm_90a): wgmma tensor cores fed from swizzled shared memory.
//
// Same algorithm and outputs as attn_fwd.cu (online base-2 softmax, O and the natural-log LSE,
// nothing N x N written); what changes is the machine: each warpgroup (4 warps) owns 64 query rows
// and issues asynchronous m64nNk16 wgmmas. S = Q K^T reads Q and K from shared memory; O += P V
// takes P from registers and V from shared memory (N-major). Within a warpgroup the next tile's
// Q K^T and this tile's P V are in flight together while the softmax of the next tile runs on
// the CUDA cores (FlashAttention-3's intra-warpgroup overlap). K and V tiles stream through two
// STAGES-deep cp.async rings: K runs one tile ahead of V because Q K^T of tile j+1 is issued
// together with P V of tile j, so K's slot frees an iteration before V's.
// PRODUCER = false: all threads load, and a block barrier per tile publishes the copies.
// PRODUCER = true (warp specialization): one more warpgroup only loads, with few registers
// (setmaxnreg), handing tiles over through mbarriers; the math warpgroups never wait for each
// other and get the registers the producer gave up.
// TMA = true (attn_fwd_wgmma_tma): the producer is one thread issuing bulk tensor copies (64-column
// boxes that land in exactly the Sw128Tile layout) completing on the "full" mbarriers; rows and
// columns past the tensor are zero-filled by the copy engine, keys past nk masked as always.
// TMA with BAND (e4m3 only, attn_fwd_wgmma_tma_fp8_band): packed sequences share one tensor, so a
// box may read rows of the neighbouring sequences (as FlashAttention-3's varlen does): their keys
// are masked (P = 0) and their query rows never stored.
// PINGPONG (two or three math warpgroups): the warpgroups take turns, round robin, issuing their
// GEMMs (named barriers 2 .. 1 + WARPGROUPS), so one's softmax runs while another's Q K^T and P V
// keep the tensor cores busy (FlashAttention-3's inter-warpgroup schedule).
#include "common.cuh"
#include "band.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "hopper/fwd_traits.cuh"
#include "hopper/fwd_smem.cuh"
#include "hopper/tile_scheduler.cuh"
#include "hopper/fwd_producer.cuh"
#include "hopper/fwd_mainloop.cuh"
#include "hopper/fwd_consumer.cuh"
#include "hopper/fwd_epilogue.cuh"
#include "hopper/fwd_split_merge.cuh"
#include "hopper/fwd_fp8.cuh"
#include "score_mod.cuh"

// HEAD_DIM_V (attn_fwd_wgmma_tma_dv): V's and O's head dim where it is not HEAD_DIM, and `dv` its
// true width (O's stored columns); else O's columns are d.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PRODUCER, bool BAND,
          bool TMA = false, bool PINGPONG = false, bool PERSISTENT = false, bool WG_EPILOGUE = false, bool SPLIT = false,
          bool MOD = false, int HEAD_DIM_V = HEAD_DIM>
__device__ __forceinline__ void
attn_fwd_wgmma_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                    int nq, int nk, int d, int group, int causal_off, float scale_log2, FwdBand band,
                    FwdMaps maps = FwdMaps{nullptr, nullptr, nullptr}, int n_heads = 0, int n_batch = 0,
                    FwdSplit split = FwdSplit{1, nullptr, nullptr, nullptr},
                    const ScoreModArgs& mods = ScoreModArgs{}, const FwdFp8Scales& fp8 = FwdFp8Scales{}, int dv = 0) {
    constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    static_assert(!(TMA && BAND) || FwdElem<T>::kFp8, "16-bit bands: the cp.async kernel (attn_fwd_wgmma_band)");
    static_assert(!PINGPONG || (WARPGROUPS >= 2 && WARPGROUPS <= 3 && PRODUCER), "ping-pong takes turns between 2 or 3 math warpgroups");
    static_assert(!PERSISTENT || (TMA && !BAND), "the persistent schedule is the TMA kernel's");
    static_assert(!SPLIT || (TMA && !BAND && !CAUSAL && !PERSISTENT), "the key split: full attention, per-tile TMA kernel");
    // MOD: rows and keys count from the sequence's first (the modifiers' positions); each tile
    // (persistent: each tile a block walks) builds its (batch entry, head)'s ScoreMod.
    static_assert(!MOD || (TMA && !BAND && !SPLIT), "score modifiers: the TMA kernels, per tile or persistent");
    // WG_EPILOGUE: each math warpgroup stages and stores only its own 64 rows of O, behind
    // warpgroup barriers (5 + wg), so the warpgroups never wait for each other at a tile's end
    // (persistent: under ping-pong their offset carries into the next tile). Without PERSISTENT O
    // is staged in Q's rows: a warpgroup's own rows, which only its own wgmma read.
    static_assert(!WG_EPILOGUE || (TMA && (PERSISTENT || !PINGPONG)),
                  "the per-warpgroup epilogue: TMA kernels, ping-pong only in the persistent one (turns)");
    using Tr = HopperFwdTraits<HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, PRODUCER, TMA, FwdElem<T>, HEAD_DIM_V>;
    // e4m3 inputs: the TMA kernel, per tile or persistent; per tile the block-wide epilogue (O
    // outgrows Q's rows), persistent either (O's own tile).
    static_assert(!Tr::kFp8 || (TMA && !SPLIT && !MOD && (PERSISTENT || !WG_EPILOGUE)),
                  "e4m3: the TMA kernel, per tile or persistent");
    // A V head dim of its own: the per-tile TMA kernel (no mask or a causal one). A per-warpgroup
    // epilogue stages O in the warpgroup's own rows of Q, which must hold them (dv <= d).
    constexpr bool kOwnDimV = HEAD_DIM_V != HEAD_DIM;
    static_assert(!kOwnDimV || (TMA && !BAND && !PERSISTENT && !SPLIT && !MOD && !Tr::kFp8),
                  "dv != d: the per-tile TMA kernel (attn_fwd_wgmma_tma_dv)");
    static_assert(!WG_EPILOGUE || PERSISTENT || Tr::TileO::kBytes <= Tr::TileQ::kBytes,
                  "the per-warpgroup epilogue stages O in its own rows of Q");
    constexpr int kBM = Tr::kBlockM, kMath = Tr::kMathThreads;
    constexpr int kNO = HEAD_DIM_V / 8;  // O's accumulator blocks
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdSmem<Tr, PERSISTENT> sm(smem_raw);

    // Blocks with the most key tiles (the last query tiles under a causal mask) start first:
    // (causal, one tile per block) within groups of Tr::kLptHeads heads, else within each head.
    int m_block = gridDim.x - 1 - blockIdx.x;
    int h = blockIdx.y;
    int b = blockIdx.z;
    if constexpr (CAUSAL && !BAND && !PERSISTENT) {
        const LptPos pos = lpt_head_groups<Tr::kLptHeads>(gridDim.x, gridDim.y * gridDim.z, grid_linear_block());
        m_block = gridDim.x - 1 - pos.rank;
        h = pos.head % gridDim.y;
        b = pos.head / gridDim.y;
    }
    // SPLIT: block x is piece `piece` of query tile `split_tile` in the plain grid's order (query
    // tiles, heads, batch).
    int piece = -1, split_tile = -1;
    if constexpr (SPLIT) {
        const int m_count = (nq + kBM - 1) / kBM;
        split_tile = blockIdx.x / split.splits;
        piece = blockIdx.x - split_tile * split.splits;
        m_block = m_count - 1 - split_tile % m_count;
        h = (split_tile / m_count) % n_heads;
        b = split_tile / (m_count * n_heads);
    }
    int hk = h / group;
    // The warpgroup and warp indices as ptxas sees them (warp_uniform): against cuDNN (H200), read
    // from lane 0 d=64 +0-3%, d=128 causal +1.5-2%, d=256 +0.5-1%, but d=128 without a mask
    // -1.2-3.7%, which keeps them per-thread.
    constexpr bool kUniformIdx = !(HEAD_DIM == 128 && !CAUSAL);
    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = kUniformIdx ? warp_uniform(tid >> 7) : tid >> 7;
    const int warp = kUniformIdx ? warp_uniform((tid >> 5) & 3) : (tid >> 5) & 3;
    int m0 = m_block * kBM;
    // Rows of this sequence: [q_row0, q_row0 + nq_b) of q, keys [k_row0, k_row0 + nk_b); the
    // plain kernel keeps nk and causal_off (its hi) as the parameters they are.
    BandSeq seq = band_sequence<BAND>(band, b, nq, nk, causal_off);
    if constexpr (BAND) {
        if (m0 >= seq.nq_b) return;  // the grid covers the longest sequence (before any barrier)
        band_bounds<BAND>(band, seq, causal_off);
    }
    int nq_b = seq.nq_b, nk_b = seq.nk_b, hi = seq.hi, lo = seq.lo;
    int q_row0 = seq.q_row0, k_row0 = seq.k_row0;
    // (TMA band: e4m3) Keys count from the start of vt's 32-key group that holds the sequence's
    // first key, k_first keys before it: P V pairs the tile's keys with vt's positions group by
    // group (hopper/fwd_fp8.cuh), so a tile starts on a group, and vt is built for the packed
    // keys as one sequence - no copy padded per sequence, no offsets. The keys before k_first (the
    // previous sequence's) are masked in every row.
    int k_first = 0;
    if constexpr (TMA && BAND) {
        k_first = k_row0 % kFp8KeyGroup;
        k_row0 -= k_first;
        nk_b += k_first;
        hi += k_first;
        lo += k_first;
    }
    int rows_valid = min(kBM, nq_b - m0);
    const u16* gQ = q + b * q_sb + h * q_sh + (i64)(q_row0 + m0) * q_sn;
    const u16* gK = k + b * k_sb + hk * k_sh + (i64)k_row0 * k_sn;
    const u16* gV = v + b * v_sb + hk * v_sh + (i64)k_row0 * v_sn;

    // Key tiles this block can see: up to the last valid row's upper limit and, under a band,
    // from the first row's lower limit (tiles outside are never loaded).
    int n_end = nk_b;
    if constexpr (kHi) n_end = max(0, min(nk_b, m0 + rows_valid + hi));
    int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    if constexpr (BAND) {
        const int n_begin = max(k_first, m0 + lo);  // the first row's lowest visible key
        const int j0 = n_begin / BLOCK_N;
        n_tiles = n_begin < n_end ? n_tiles - j0 : 0;
        // From here on keys count from key tile j0 and rows from m0 (the K/V pointers, the key
        // count and the bounds move), so the loop keeps as few values live as the plain kernel's.
        const int kb = j0 * BLOCK_N;
        gK += (i64)kb * k_sn;
        gV += (i64)kb * v_sn;
        nk_b -= kb;
        hi += m0 - kb;
        lo += m0 - kb;
        k_first -= kb;
        if constexpr (TMA) k_row0 += kb;  // the key coordinate of the first tile
    }

    // SPLIT: a piece's key tiles, [piece, piece + 1) * n_tiles / splits; keys count from its first
    // (piece_k0), so the mask of the last tile's end and the loop are the whole tile's.
    int piece_k0 = 0;
    if constexpr (SPLIT) {
        const int t0 = piece * n_tiles / split.splits, t1 = (piece + 1) * n_tiles / split.splits;
        piece_k0 = t0 * BLOCK_N;
        n_tiles = t1 - t0;
        nk_b -= piece_k0;
    }

    // PERSISTENT (hopper/tile_scheduler.cuh): the K/V ring and the barriers' phases run on across
    // tiles: kv0 counts the key tiles of this block's earlier tiles, q_phase their parity.
    const FwdTileScheduler<CAUSAL, PERSISTENT> sched(nq, kBM, n_heads, n_batch);
    auto set_tile = [&](int bh, int mb) {
        m_block = mb;
        h = bh % n_heads;
        hk = h / group;
        b = bh / n_heads;
        m0 = m_block * kBM;
        rows_valid = min(kBM, nq - m0);
        n_end = nk;
        if constexpr (kHi) n_end = max(0, min(nk, m0 + rows_valid + hi));
        n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;
    };
    int kv0 = 0;
    u32 q_phase = 0;
    // (e4m3) the scores' descales join their scale (FlashAttention-3's folding): here once per
    // block, or (persistent, whose tiles change batch entry and head) per tile in math().
    if constexpr (Tr::kFp8 && !PERSISTENT) scale_log2 *= fp8.qk(b, h, hk);
    // The math warpgroups' part: everything after the tiles start arriving (hopper/fwd_consumer.cuh).
    using Consumer = FwdConsumer<T, Tr, CAUSAL, PRODUCER, BAND, TMA, PINGPONG, PERSISTENT, SPLIT, MOD>;
    auto math = [&]() {
        const float tile_scale = Tr::kFp8 && PERSISTENT ? scale_log2 * fp8.qk(b, h, hk) : scale_log2;
        // The warpgroup's registers: O (zero), S, P and the online softmax's state.
        float acc_o[1][kNO][4];
    #pragma unroll
        for (int ni = 0; ni < kNO; ++ni)
    #pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[0][ni][e] = 0.f;
        float acc_s[1][Consumer::kNS][4];
        u32 p_frag[Tr::kPvSteps][4];
        OnlineSoftmax<2> softmax;
        float alpha[2];
        bool moved = true;
        // (MOD) this (batch entry, head)'s softcap and ALiBi slope, and its sink in the softmax.
        ScoreMod mod{};
        if constexpr (MOD) {
            mod = ScoreMod(mods, b, h, nq, nk);
            softmax.add_sink(sink_raw(mods, h), lane);
        }
        const FwdKvSource src{gK, gV, k_sn, v_sn, d, tid};
        Consumer c(acc_o, acc_s, p_frag, softmax, alpha, moved, sm, src, kv0, q_phase, m0, rows_valid, wg, warp, lane,
                   nk_b, hi, lo, n_tiles, tile_scale, mod, k_first);
        c.prologue();  // S_0 and its probabilities
        // K/V tile j: P_j V_j with S_{j+1} = Q K_{j+1}^T in flight, then the softmax of tile j+1.
        for (int j = 0; j + 1 < c.n_mine; ++j) c.step(j, true);
        if (c.n_mine > 0) c.step(c.n_mine - 1, false);
        c.skip_rest();
        c.template before_epilogue<WG_EPILOGUE>();

        float row_lse[2];
        softmax.template finalize<1, kNO>(acc_o, tile_scale, row_lse);
        if constexpr (Tr::kFp8) {  // v's descale on O (P V took vt's raw e4m3 values)
            const float vs = fp8.out(b, hk);
    #pragma unroll
            for (int ni = 0; ni < kNO; ++ni)
    #pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[0][ni][e] *= vs;
        }
        if constexpr (SPLIT) {
            if (split_merge<kNO, kMath, kBM>(split, piece, split_tile, tid, lane, c.row0, acc_o, row_lse)) return;
        }

        const FwdOut out{o, lse, o_sb, o_sh, o_sn, nq, PERSISTENT || SPLIT ? (u32)n_heads : gridDim.y, kOwnDimV ? dv : d};
        if constexpr (Tr::kFp8 && PERSISTENT) {
            fwd_store_tile_direct<T>(acc_o, row_lse, out, b, h, m0, rows_valid, c.row0, lane);
        } else {
            fwd_store_tile<T, Tr, PRODUCER, WG_EPILOGUE, BAND>(acc_o, row_lse, sm.sO, out, band.cu_q, b, h, q_row0, m0,
                                                               rows_valid, c.row0, wg, tid, lane);
        }
    };
    if constexpr (PRODUCER) {
        if (tid == 0) fwd_init_barriers<Tr, TMA, PERSISTENT>(sm);
        __syncthreads();  // the last block-wide barrier: the roles split here
        // One if/else per role, so that ptxas applies each branch's setmaxnreg to its code.
        if (TMA && wg == WARPGROUPS) {  // the TMA producer: one thread issues every copy
            setmaxnreg_dec<Tr::kProducerRegs>();
            if (tid == kMath) {
                if constexpr (PERSISTENT) {
                    sched.for_each_tile([&](int bh, int mb) {
                        set_tile(bh, mb);
                        fwd_tma_tile_loads<Tr, PERSISTENT>(sm, maps, m0, h, hk, b, n_tiles, kv0, q_phase, piece_k0);
                        kv0 += n_tiles;
                        q_phase ^= 1;
                    });
                } else {  // (packed sequences: rows and keys from the sequence's own)
                    fwd_tma_tile_loads<Tr, PERSISTENT>(sm, maps, q_row0 + m0, h, hk, b, n_tiles, kv0, q_phase,
                                                       k_row0 + piece_k0);
                }
            }
        } else if (!TMA && wg == WARPGROUPS) {  // the cp.async producer
            setmaxnreg_dec<Tr::kProducerRegs>();
            fwd_cp_async_producer<Tr>(sm, gQ, gK, gV, q_sn, k_sn, v_sn, rows_valid, nk_b, d, n_tiles, tid - kMath);
        } else {
            setmaxnreg_inc<Tr::kMathRegs>();
            if constexpr (PERSISTENT) {
                sched.for_each_tile([&](int bh, int mb) {
                    set_tile(bh, mb);
                    math();
                    kv0 += n_tiles;
                    q_phase ^= 1;
                });
            } else {
                math();
            }
        }
    } else {
        fwd_cp_async_prologue<Tr>(sm, gQ, gK, gV, q_sn, k_sn, v_sn, rows_valid, nk_b, d, n_tiles, tid);
        math();
    }
}

// The same kernel fed by the bulk tensor copy engine: Q, K and V as rank-4 tensor maps (d, rows,
// heads, batch) with 64 x rows boxes (Q: kBlockM rows, K/V: BLOCK_N); the pointers and strides
// of Q, K and V are the plain kernel's (unused but for a uniform launch).
#define FWD_TMA_PARAMS                                                                                          \
    const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_k,                             \
        const __grid_constant__ TmaDesc tmap_v, const u16 *__restrict__ q, const u16 *__restrict__ k,           \
        const u16 *__restrict__ v, u16 *__restrict__ o, float *__restrict__ lse, i64 q_sb, i64 q_sh, i64 q_sn, \
        i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn, int nq,      \
        int nk, int d, int group, int causal_off, float scale_log2
#define FWD_TMA_ARGS                                                                                            \
    q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, nq, nk, d, group,  \
        causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr}, FwdMaps{&tmap_q, &tmap_k, &tmap_v}
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma(FWD_TMA_PARAMS) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, false, WG_EPILOGUE>(
        FWD_TMA_ARGS);
}

// The TMA kernel as a persistent one: gridDim.x blocks, one per SM, each walking its share of the
// work units (query tiles; causal: pairs of them) of n_batch x n_heads (attn_fwd_wgmma_body's
// unit_tile). Its producer fetches the next tile's first K and its Q while the math warpgroups
// finish this tile (P V and the O store), which a fresh block per tile leaves exposed - at N = 1k
// a block has only 8 key tiles to hide them.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_persistent(FWD_TMA_PARAMS, int n_heads, int n_batch) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, true, WG_EPILOGUE>(
        FWD_TMA_ARGS, n_heads, n_batch);
}
// The key split (FwdSplit): a 1-D grid of splits x (query tiles) blocks, piece-major per tile, so
// each tile's last piece (which merges) is launched after the others. A kernel of its own: the
// piece bounds in the plain body's loop change ptxas's schedule of it (2-4% slower, measured).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_split(FWD_TMA_PARAMS, int n_heads, int splits, float* __restrict__ part_o,
                         float* __restrict__ part_lse, unsigned* __restrict__ flags) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, false, true, false, true, PINGPONG, false,
                        WG_EPILOGUE, true>(FWD_TMA_ARGS, n_heads, 0, FwdSplit{splits, part_o, part_lse, flags});
}
// The per-tile TMA kernel with score modifiers (score_mod.cuh: softcap, ALiBi, sinks), no mask
// or a causal one; windows and packed sequences with modifiers run attn_fwd_band_mod. alibi is
// batch x alibi_sb + head, offset to the launch's first batch entry.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_mod(FWD_TMA_PARAMS, float cap_ex2, float cap_out, float inv_scale, const float* __restrict__ alibi,
                       int alibi_sb, const float* __restrict__ sinks) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, false, WG_EPILOGUE,
                        false, true>(FWD_TMA_ARGS, 0, 0, FwdSplit{1, nullptr, nullptr, nullptr},
                                     ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, sinks});
}
// The persistent TMA kernel with score modifiers: where the plain kernel of a shape is persistent
// (short sequences), so is the modified one (causal N = 4k at d = 128: a fresh block per tile
// leaves each tile's start and end exposed).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_persistent_mod(FWD_TMA_PARAMS, int n_heads, int n_batch, float cap_ex2, float cap_out,
                                  float inv_scale, const float* __restrict__ alibi, int alibi_sb,
                                  const float* __restrict__ sinks) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, true, WG_EPILOGUE,
                        false, true>(FWD_TMA_ARGS, n_heads, n_batch, FwdSplit{1, nullptr, nullptr, nullptr},
                                     ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, sinks});
}
// v (and o) with a head dim dv unlike q's and k's d (DeepSeek MLA's prefill: 192 / 128): the per-tile
// TMA kernel with HEAD_DIM_V-wide V slots, O accumulators and P V wgmmas (HopperFwdTraits), so
// neither side is zero-padded to the other; no mask or a causal one. v's map has dv columns (its
// boxes zero-fill up to HEAD_DIM_V), and `dv` bounds O's stored columns as `d` does Q's and K's.
template <typename T, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL,
          bool PINGPONG = false, bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_dv(FWD_TMA_PARAMS, int dv) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, false, WG_EPILOGUE,
                        false, false, HEAD_DIM_V>(FWD_TMA_ARGS, 0, 0, FwdSplit{1, nullptr, nullptr, nullptr},
                                                  ScoreModArgs{}, FwdFp8Scales{}, dv);
}
#undef FWD_TMA_PARAMS
#undef FWD_TMA_ARGS

// e4m3 q, k, v (T = E4m3<Bf16 or Fp16>: the output's type; hopper/fwd_fp8.cuh): the TMA kernel on
// byte tensor maps - Q and K (d, rows, heads, batch) in 128-column boxes, vt (keys, d, heads,
// batch) in 128-key boxes of HEAD_DIM rows - with the descales' pointers and element strides
// (FwdFp8Scales), no mask or a causal one. o and lse as the 16-bit kernels'.
#define FWD_FP8_PARAMS                                                                                          \
    const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_k,                             \
        const __grid_constant__ TmaDesc tmap_vt, u16 *__restrict__ o, float *__restrict__ lse, i64 o_sb,         \
        i64 o_sh, i64 o_sn, int nq, int nk, int d, int group, int causal_off, float scale_log2,                 \
        const float *__restrict__ q_descale, const float *__restrict__ k_descale,                               \
        const float *__restrict__ v_descale, int qd_sb, int qd_sh, int qd_shk, int kd_sb, int kd_sh, int vd_sb,  \
        int vd_sh
#define FWD_FP8_ARGS(N_HEADS, N_BATCH)                                                                          \
    nullptr, nullptr, nullptr, o, lse, 0, 0, 0, 0, 0, 0, 0, 0, 0, o_sb, o_sh, o_sn, nq, nk, d, group, causal_off, \
        scale_log2, FwdBand{0, 0, nullptr, nullptr}, FwdMaps{&tmap_q, &tmap_k, &tmap_vt}, N_HEADS, N_BATCH,     \
        FwdSplit{1, nullptr, nullptr, nullptr}, ScoreModArgs{},                                                 \
        FwdFp8Scales{q_descale, k_descale, v_descale, qd_sb, qd_sh, qd_shk, kd_sb, kd_sh, vd_sb, vd_sh}
// One query tile per block (grid: query tiles, heads, batch).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_fp8(FWD_FP8_PARAMS) {
    static_assert(FwdElem<T>::kFp8, "T: E4m3<Bf16> or E4m3<Fp16>");
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG>(
        FWD_FP8_ARGS(0, 0));
}
// Persistent (as attn_fwd_wgmma_tma_persistent): one block per SM walks the work units of n_batch x
// n_heads, the next tile's first K and Q loading while this one ends; O stored from the
// accumulators (fwd_store_tile_direct: the rings of a 224-key tile leave no room for O's).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PINGPONG = false,
          bool WG_EPILOGUE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_fp8_persistent(FWD_FP8_PARAMS, int n_heads, int n_batch) {
    static_assert(FwdElem<T>::kFp8, "T: E4m3<Bf16> or E4m3<Fp16>");
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, true, false, true, PINGPONG, true,
                        WG_EPILOGUE>(FWD_FP8_ARGS(n_heads, n_batch));
}
#undef FWD_FP8_PARAMS
#undef FWD_FP8_ARGS

// e4m3 with a sliding window and/or packed sequences: attn_fwd_wgmma_tma_fp8's maps and descales
// with attn_fwd_wgmma_band's bounds (hi_off, lo_off, align) and offsets (cu_q, cu_k: null for an
// ordinary batch). Packed: the maps are the (1, H, total, d) arrays' (vt: (1, Hkv, d, total_k
// rounded up to 32)), batch entry 0 for every sequence; the descales per tensor.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PINGPONG = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + 128, 1)
attn_fwd_wgmma_tma_fp8_band(const __grid_constant__ TmaDesc tmap_q, const __grid_constant__ TmaDesc tmap_k,
                            const __grid_constant__ TmaDesc tmap_vt, u16* __restrict__ o, float* __restrict__ lse,
                            i64 o_sb, i64 o_sh, i64 o_sn, int nq, int nk, int d, int group, int hi_off,
                            float scale_log2, int lo_off, int align, const int* __restrict__ cu_q,
                            const int* __restrict__ cu_k, const float* __restrict__ q_descale,
                            const float* __restrict__ k_descale, const float* __restrict__ v_descale, int qd_sb,
                            int qd_sh, int qd_shk, int kd_sb, int kd_sh, int vd_sb, int vd_sh) {
    static_assert(FwdElem<T>::kFp8, "T: E4m3<Bf16> or E4m3<Fp16>");
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, true, true, true, true, PINGPONG>(
        nullptr, nullptr, nullptr, o, lse, 0, 0, 0, 0, 0, 0, 0, 0, 0, o_sb, o_sh, o_sn, nq, nk, d, group, hi_off,
        scale_log2, FwdBand{lo_off, align, cu_q, cu_k}, FwdMaps{&tmap_q, &tmap_k, &tmap_vt}, 0, 0,
        FwdSplit{1, nullptr, nullptr, nullptr}, ScoreModArgs{},
        FwdFp8Scales{q_descale, k_descale, v_descale, qd_sb, qd_sh, qd_shk, kd_sb, kd_sh, vd_sb, vd_sh});
}

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool CAUSAL, bool PRODUCER = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + (PRODUCER ? 128 : 0), 1)
attn_fwd_wgmma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               u16* __restrict__ o, float* __restrict__ lse,
               i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
               i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
               int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, CAUSAL, PRODUCER, false>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr});
}

// Sliding window and/or packed sequences (the arguments of attn_fwd_band): both bounds at run time
// (an open side clamps away) and per-sequence lengths. A kernel of its own so the plain kernels'
// code stays as it was. At d = 64 two blocks share an SM (the plain kernel fits 128 registers
// on its own; the band's bounds need the hint).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool PRODUCER = false>
__global__ void __launch_bounds__(WARPGROUPS * 128 + (PRODUCER ? 128 : 0), HEAD_DIM <= 64 && !PRODUCER ? 2 : 1)
attn_fwd_wgmma_band(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                    u16* __restrict__ o, float* __restrict__ lse,
                    i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                    i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                    int nq, int nk, int d, int group, int hi_off, float scale_log2,
                    int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    attn_fwd_wgmma_body<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES, true, PRODUCER, true>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, hi_off, scale_log2, FwdBand{lo_off, align, cu_q, cu_k});
}
