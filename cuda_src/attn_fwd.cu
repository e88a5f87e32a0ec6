// Tiled forward attention, FlashAttention-2 partitioning, mma.sync tensor cores (sm_80+).
//
// One block per (query tile, head, batch). Each warp owns kRowsPerWarp query rows of the tile, so
// softmax statistics never cross warps. K/V tiles stream through a kStages-deep cp.async ring in
// shared memory; S = Q K^T and O += P V run on m16n8k16 tensor cores with float32 accumulation;
// the softmax is online, in base 2, and O is normalized once at the end. Nothing N x N is written:
// the only outputs are O and the float32 log-sum-exp (natural log) per query row.
#include "common.cuh"
#include "band.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tile_load.cuh"

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES>
struct FwdTraits {
    static constexpr int kHeadDim = HEAD_DIM;  // padded head dim held on chip (multiple of 32/64)
    static constexpr int kBlockM = BLOCK_M;    // query rows per block
    static constexpr int kBlockN = BLOCK_N;    // keys per K/V tile
    static constexpr int kWarps = WARPS;
    static constexpr int kThreads = WARPS * 32;
    static constexpr int kStages = STAGES;     // K/V tiles in flight
    static constexpr int kRowsPerWarp = BLOCK_M / WARPS;
    static constexpr int kMmaM = kRowsPerWarp / 16;  // 16-row accumulator tiles per warp
    static constexpr int kNTilesS = BLOCK_N / 8;     // 8-column tiles of S per row tile
    static constexpr int kNTilesO = HEAD_DIM / 8;    // 8-column tiles of O per row tile
    static constexpr int kChunks = HEAD_DIM / 8;     // 16-byte chunks per row
    static constexpr int kTileQ = BLOCK_M * HEAD_DIM;
    static constexpr int kTileKV = BLOCK_N * HEAD_DIM;
    static constexpr int kSmemBytes = (kTileQ + 2 * kStages * kTileKV) * 2;
    // Keep the warp's Q fragments in registers instead of re-reading them from shared memory for
    // every K/V tile: saves a fifth of the ldmatrix traffic, costs kMmaM * HEAD_DIM / 4 registers,
    // which only small head dims can afford without spilling.
    static constexpr bool kQInRegs = HEAD_DIM <= 64;
    using Swz = Swizzle<HEAD_DIM>;
    static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole 16-row mma tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "mma k-steps are 16 wide");
    static_assert((BLOCK_M * kChunks) % kThreads == 0 && (BLOCK_N * kChunks) % kThreads == 0,
                  "tile loads split evenly over the threads");
    static_assert(STAGES >= 2, "the ring needs one tile in use and one in flight");
};

// One K/V tile (keys n0 .. n0 + BLOCK_N - 1, zero past nk_b) into ring slot `slot` (no commit).
template <typename Tr, bool VEC>
__device__ __forceinline__ void fwd_load_kv(u16* sK, u16* sV, int slot, const u16* gK, const u16* gV, i64 k_sn, i64 v_sn,
                                            int n0, int nk_b, int d) {
    load_tile_rows<Tr::kHeadDim, Tr::kBlockN, Tr::kThreads, VEC>(sK + slot * Tr::kTileKV, gK + n0 * k_sn, k_sn, nk_b - n0, d,
                                                                threadIdx.x);
    load_tile_rows<Tr::kHeadDim, Tr::kBlockN, Tr::kThreads, VEC>(sV + slot * Tr::kTileKV, gV + n0 * v_sn, v_sn, nk_b - n0, d,
                                                                threadIdx.x);
}

// S = Q K^T for the warp's rows against the tile in ring slot bytes `slot_bytes`: Q's A fragments
// from q_frag (kQInRegs) or by ldmatrix, K's B fragments by ldmatrix, 16 keys per load.
template <typename T, typename Tr, int QM, int QK>
__device__ __forceinline__ void fwd_scores(float (&acc_s)[Tr::kMmaM][Tr::kNTilesS][4], const u32 (&q_frag)[QM][QK][4],
                                           const LaneAddr<Tr::kHeadDim>& aQ, const LaneAddr<Tr::kHeadDim>& aK,
                                           u32 slot_bytes) {
    constexpr int kMmaM = Tr::kMmaM;
    zero_acc(acc_s);
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
        u32 a[kMmaM][4];
#pragma unroll
        for (int mi = 0; mi < kMmaM; ++mi) {
            if constexpr (Tr::kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[mi][e] = q_frag[mi][kk][e];
            } else {
                ldmatrix_x4(a[mi], aQ.at(mi * 16, kk * 2));
            }
        }
        mma_a_times_kt<T>(acc_s, a, aK, kk, slot_bytes);
    }
}

// The warp's normalized O, float32 (O32), straight from the accumulator fragments: a lane holds two
// adjacent columns of a row (8 bytes), four lanes 32 contiguous bytes of it. gO: the tile's row 0.
template <typename Tr, bool VEC>
__device__ __forceinline__ void fwd_store_o32(float* gO, const float (&acc_o)[Tr::kMmaM][Tr::kNTilesO][4], int warp_row0,
                                              int rows_valid, i64 o_sn, int d, int lane) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMmaM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = warp_row0 + mi * 16 + (lane >> 2) + hf * 8;
            if (row >= rows_valid) continue;
#pragma unroll
            for (int di = 0; di < Tr::kNTilesO; ++di) {
                const int col = di * 8 + 2 * (lane & 3);
                const float x0 = acc_o[mi][di][2 * hf], x1 = acc_o[mi][di][2 * hf + 1];
                if constexpr (VEC) {  // rows 16-byte aligned, d a multiple of 8
                    float2 pair;
                    pair.x = x0;
                    pair.y = x1;
                    if (col < d) *reinterpret_cast<float2*>(gO + row * o_sn + col) = pair;
                } else {
                    if (col < d) gO[row * o_sn + col] = x0;
                    if (col + 1 < d) gO[row * o_sn + col + 1] = x1;
                }
            }
        }
}

// The warp's rows of O in 16 bits, staged in shared memory (the warp's own rows of the Q tile, only
// it read them) for a coalesced store.
template <typename T, typename Tr>
__device__ __forceinline__ void fwd_stage_o16(u16* sQ, const float (&acc_o)[Tr::kMmaM][Tr::kNTilesO][4], int warp_row0,
                                              int lane) {
#pragma unroll
    for (int mi = 0; mi < Tr::kMmaM; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = warp_row0 + mi * 16 + (lane >> 2) + hf * 8;
#pragma unroll
            for (int di = 0; di < Tr::kNTilesO; ++di) {
                u16* dst = sQ + Tr::Swz::offset(row, di * 8) + 2 * (lane & 3);
                *reinterpret_cast<u32*>(dst) = pack2<T>(acc_o[mi][di][2 * hf], acc_o[mi][di][2 * hf + 1]);
            }
        }
}
// The warp's rows' log-sum-exp (lane 0 of each quad holds its rows' values). gL: the tile's row 0.
template <typename Tr>
__device__ __forceinline__ void fwd_store_lse(float* gL, const float (&row_lse)[2 * Tr::kMmaM], int warp_row0,
                                              int rows_valid, int lane) {
    if ((lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2 * Tr::kMmaM; ++r) {
            const int row = warp_row0 + (r / 2) * 16 + (lane >> 2) + (r % 2) * 8;
            if (row < rows_valid) gL[row] = row_lse[r];
        }
    }
}

// O32: o is float32 (cuflash.attention(out_dtype=float32)): the normalized accumulator is stored
// as it is, never rounded to 16 bits; o points to floats and its strides count floats.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          bool LAZY_RESCALE, bool BAND, bool MOD = false, bool O32 = false>
__device__ __forceinline__ void
attn_fwd_body(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
              u16* __restrict__ o, float* __restrict__ lse,
              i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
              i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
              int nq, int nk, int d, int group, int causal_off, float scale_log2, FwdBand band,
              const ScoreModArgs& mods = ScoreModArgs{}) {
    using Tr = FwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES>;
    constexpr int kMmaM = Tr::kMmaM, kNS = Tr::kNTilesS, kNO = Tr::kNTilesO;
    constexpr bool kHi = CAUSAL || BAND;  // an upper bound j <= i + hi exists
    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sK = sQ + Tr::kTileQ;
    u16* sV = sK + STAGES * Tr::kTileKV;

    // Blocks with the most key tiles (the last query tiles under a causal mask) start first.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, hk = h / group;
    int b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = m_block * BLOCK_M;
    // Rows of this sequence: [q_row0, q_row0 + nq_b) of q, keys [k_row0, k_row0 + nk_b).
    BandSeq seq = band_sequence<BAND>(band, b, nq, nk, causal_off);
    if constexpr (BAND) {
        if (m0 >= seq.nq_b) return;  // the grid covers the longest sequence
        band_bounds<BAND>(band, seq, causal_off);
    }
    int nq_b = seq.nq_b, nk_b = seq.nk_b, hi = seq.hi, lo = seq.lo;
    int q_row0 = seq.q_row0, k_row0 = seq.k_row0;
    const int rows_valid = min(BLOCK_M, nq_b - m0);

    const u16* gQ = q + b * q_sb + h * q_sh + (i64)(q_row0 + m0) * q_sn;
    const u16* gK = k + b * k_sb + hk * k_sh + (i64)k_row0 * k_sn;
    const u16* gV = v + b * v_sb + hk * v_sh + (i64)k_row0 * v_sn;
    int j0, n_tiles;
    band_key_tiles<BLOCK_N, kHi, BAND>(m0, rows_valid, nk_b, hi, lo, j0, n_tiles);

    // Prologue: Q and the first STAGES-1 K/V tiles in flight (one commit group per tile).
    load_tile_rows<HEAD_DIM, BLOCK_M, Tr::kThreads, VEC>(sQ, gQ, q_sn, rows_valid, d, threadIdx.x);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_tiles) fwd_load_kv<Tr, VEC>(sK, sV, s, gK, gV, k_sn, v_sn, (j0 + s) * BLOCK_N, nk_b, d);
        cp_async_commit();
    }

    float acc_o[kMmaM][kNO][4];
    zero_acc(acc_o);
    OnlineSoftmax<2 * kMmaM> softmax;
    // (MOD) the score modifier of this (sequence, head): slopes are indexed by grid z, which is
    // the sequence also for packed ones (b is 0 there).
    ScoreMod mod{};
    if constexpr (MOD) {
        mod = ScoreMod(mods, blockIdx.z, h, nq_b, nk_b);
        softmax.add_sink(sink_raw(mods, h), lane);
    }

    constexpr int kKStepsQK = HEAD_DIM / 16;
    u32 q_frag[Tr::kQInRegs ? kMmaM : 1][Tr::kQInRegs ? kKStepsQK : 1][4];
    const int warp_row0 = warp * Tr::kRowsPerWarp;  // first row of this warp within the tile
    // ldmatrix lanes: A (Q) rows lane&15, chunk lane>>4; K rows (lane>>4)*8 + lane&7, chunk
    // (lane>>3)&1; V (transposed) rows ((lane>>3)&1)*8 + lane&7, chunk lane>>4.
    const u32 sbase = smem_addr(smem);
    const LaneAddr<HEAD_DIM> aQ(sbase, warp_row0 + (lane & 15), lane >> 4);
    const LaneAddr<HEAD_DIM> aK(sbase + Tr::kTileQ * 2, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
    const LaneAddr<HEAD_DIM> aV(sbase + (Tr::kTileQ + STAGES * Tr::kTileKV) * 2, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
    for (int j = 0; j < n_tiles; ++j) {
        // Tile j has landed for every thread, and every warp is done with tile j-1's slot.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int jn = j + STAGES - 1;
            if (jn < n_tiles) fwd_load_kv<Tr, VEC>(sK, sV, jn % STAGES, gK, gV, k_sn, v_sn, (j0 + jn) * BLOCK_N, nk_b, d);
            cp_async_commit();
        }
        const u32 slot_bytes = (j % STAGES) * Tr::kTileKV * 2;
        if constexpr (Tr::kQInRegs) {
            if (j == 0) {  // Q landed with tile 0
#pragma unroll
                for (int kk = 0; kk < kKStepsQK; ++kk)
#pragma unroll
                    for (int mi = 0; mi < kMmaM; ++mi) ldmatrix_x4(q_frag[mi][kk], aQ.at(mi * 16, kk * 2));
            }
        }
        float acc_s[kMmaM][kNS][4];
        fwd_scores<T, Tr>(acc_s, q_frag, aQ, aK, slot_bytes);

        // Score modifiers, then the mask: keys past the end and, under causality, keys after each
        // row's diagonal (and, under a band, keys before its lower limit).
        const int n0 = (j0 + j) * BLOCK_N;
        if constexpr (MOD) {  // softcap and ALiBi before the mask
#pragma unroll
            for (int mi = 0; mi < kMmaM; ++mi) mod.apply_rows(acc_s[mi], m0 + warp_row0 + mi * 16 + (lane >> 2), n0, lane);
        }
        if (band_tile_needs_mask<BLOCK_N, Tr::kRowsPerWarp, kHi, BAND>(n0, nk_b, m0 + warp_row0, hi, lo)) {
#pragma unroll
            for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    mask_score_row<kHi, BAND>(acc_s[mi], hf, m0 + warp_row0 + mi * 16 + (lane >> 2) + hf * 8, n0, nk_b,
                                              hi, lo, lane);
        }

        // Online softmax: S becomes unnormalized P (in place); O is rescaled if a row max moved.
        softmax.template update<kMmaM, kNS, kNO, LAZY_RESCALE>(acc_s, acc_o, scale_log2);

        // O += P V, with P taken straight from the S accumulators (C layout == A layout).
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) mma_acc_times_bt<T>(acc_o, acc_s, kk, aV, kk * 16, 0, slot_bytes);
    }
    // Every thread's copies (Q's included, when no K/V tile was visible) have landed before any
    // warp reuses its rows of sQ for the output.
    cp_async_wait<0>();
    __syncthreads();

    // Normalize once; rows that saw no key give O = 0 and lse = -inf.
    float row_lse[2 * kMmaM];
    softmax.template finalize<kMmaM, kNO>(acc_o, scale_log2, row_lse);

    if constexpr (O32) {
        fwd_store_o32<Tr, VEC>(reinterpret_cast<float*>(o) + b * o_sb + h * o_sh + (i64)(q_row0 + m0) * o_sn, acc_o,
                               warp_row0, rows_valid, o_sn, d, lane);
    } else {
        __syncwarp();
        fwd_stage_o16<T, Tr>(sQ, acc_o, warp_row0, lane);
        __syncwarp();
        if constexpr (BAND) {  // re-read rather than keep live through the loop (registers)
            if (band.cu_q != nullptr) q_row0 = band.cu_q[blockIdx.z];
        }
        // 16 bytes per lane, coalesced along rows. (In the body: as a function of sQ and gO the
        // store made ptxas spill 4 bytes in attn_fwd_band_mod at d = 256, which sits at 255 registers.)
        u16* gO = o + b * o_sb + h * o_sh + (i64)(q_row0 + m0) * o_sn;
        constexpr int kStoreIters = Tr::kRowsPerWarp * Tr::kChunks / 32;
#pragma unroll
        for (int it = 0; it < kStoreIters; ++it) {
            const int i = it * 32 + lane;
            const int row = warp_row0 + i / Tr::kChunks;
            const int col = (i % Tr::kChunks) * 8;
            if (row < rows_valid && col < d) {
                const uint4 val = *reinterpret_cast<const uint4*>(sQ + Tr::Swz::offset(row, col));
                if constexpr (VEC) {
                    *reinterpret_cast<uint4*>(gO + row * o_sn + col) = val;
                } else {
                    const u32 w[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        if (col + e < d) gO[row * o_sn + col + e] = (u16)(w[e / 2] >> (16 * (e % 2)));
                }
            }
        }
    }
    fwd_store_lse<Tr>(lse + ((i64)b * gridDim.y + h) * nq + (q_row0 + m0), row_lse, warp_row0, rows_valid, lane);
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          bool LAZY_RESCALE = true>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
         u16* __restrict__ o, float* __restrict__ lse,
         i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
         i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
         int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_fwd_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, LAZY_RESCALE, false>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr});
}

// attn_fwd with a float32 o (out_dtype=float32): a kernel of its own, so attn_fwd's code stays as it was.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool CAUSAL, bool VEC,
          bool LAZY_RESCALE = true>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd_o32(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
             float* __restrict__ o, float* __restrict__ lse,
             i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
             i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
             int nq, int nk, int d, int group, int causal_off, float scale_log2) {
    attn_fwd_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, CAUSAL, VEC, LAZY_RESCALE, false, false, true>(
        q, k, v, reinterpret_cast<u16*>(o), lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh,
        o_sn, nq, nk, d, group, causal_off, scale_log2, FwdBand{0, 0, nullptr, nullptr});
}

// Sliding window and/or packed sequences: both bounds at run time (an open side clamps away) and
// per-sequence lengths. A kernel of its own so the plain kernels' code stays as it was.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool VEC, bool LAZY_RESCALE>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd_band(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
              u16* __restrict__ o, float* __restrict__ lse,
              i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
              i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
              int nq, int nk, int d, int group, int hi_off, float scale_log2,
              int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    attn_fwd_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, true, VEC, LAZY_RESCALE, true>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, hi_off, scale_log2, FwdBand{lo_off, align, cu_q, cu_k});
}

// The band kernel with score modifiers (score_mod.cuh): every forward with softcap, ALiBi or sinks
// runs it (its run-time bounds cover no mask, causal, windows and packed sequences). alibi is
// (batch or sequence) x alibi_sb + head, offset to the launch's first batch entry or sequence.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, int STAGES, bool VEC, bool LAZY_RESCALE>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd_band_mod(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                  u16* __restrict__ o, float* __restrict__ lse,
                  i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
                  i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
                  int nq, int nk, int d, int group, int hi_off, float scale_log2,
                  int lo_off, int align, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                  float cap_ex2, float cap_out, float inv_scale, const float* __restrict__ alibi, int alibi_sb,
                  const float* __restrict__ sinks) {
    attn_fwd_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, true, VEC, LAZY_RESCALE, true, true>(
        q, k, v, o, lse, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,
        nq, nk, d, group, hi_off, scale_log2, FwdBand{lo_off, align, cu_q, cu_k},
        ScoreModArgs{cap_ex2, cap_out, inv_scale, alibi, alibi_sb, sinks});
}
